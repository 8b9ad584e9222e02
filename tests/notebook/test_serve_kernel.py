"""`%dendrite serve` in a real kernel (issue 41's last "Done when"): a chat request sent from outside shows up in the
notebook's tree, and the notebook forks it and generates on the fork. The kernel runs the real default model
(SmolLM2-135M-Instruct, on the CPU), driven over ZeroMQ as JupyterLab drives it; this test process is the outside
client, with the `openai` package."""
import httpx
import openai
import pytest

from tests.support.kernel_client import execute, running_kernel, text_of

pytest.importorskip("jupyter_client")


def run(client, code):
    """Run one cell in the kernel; its printed and displayed text."""
    reply, outputs = execute(client, code)
    assert reply["status"] == "ok", text_of(outputs)
    return text_of(outputs)


def test_a_request_from_outside_shows_in_the_tree_and_the_notebook_forks_it(real_gguf):
    with running_kernel() as (_, client):
        run(client, "%load_ext dendrite_nb\nfrom dendrite_nb.magics import current_engine")
        run(client, f"%dendrite load {real_gguf} --num-blocks 256")
        url = run(client, "served = %dendrite serve --port 0\nprint(served.url)").strip().splitlines()[-1]
        assert url.startswith("http://127.0.0.1:") and url.endswith("/v1")

        reply = openai.OpenAI(base_url=url, api_key="unused", max_retries=0).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Name a river."}], max_tokens=8, temperature=0)
        seen = run(client, f"view = %tree\neng = current_engine()\n"
                           f"print({reply.id!r} in eng.branches, any({reply.id!r} in n['label'] for n in view._nodes),"
                           f" {reply.choices[0].message.content!r} in eng.text({reply.id!r}))")
        assert seen.split()[-3:] == ["True", "True", "True"]
        assert f"server: {url}, 0 requests waiting, 1 response kept" in run(client, "%dendrite status")

        run(client, f"%fork {reply.id} mine")
        grown = run(client, "r = %gen mine -n 4 -t 0 --ignore-eos\n"
                            f"print(len(r.tokens[0]), eng.branch('mine').tokens[:len(eng.branch({reply.id!r}))]"
                            f" == eng.branch({reply.id!r}).tokens)")
        assert grown.split()[-2:] == ["4", "True"]

        assert run(client, "%dendrite serve stop").strip().startswith(f"stopped the server at {url}")
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{url}/models", timeout=5)
