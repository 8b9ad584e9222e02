"""`%dendrite load PATH --tp N` through a real IPython shell: the engine split over two gloo processes (the tiny
llama-gqa-untied checkpoint, 4 heads and 2 KV heads), what the load result and `%dendrite status` say about its
ranks, the same tokens as one process, refusals that change nothing, `%dendrite restore --tp 2`, and --replace
closing a tensor-parallel engine (its worker ended) before the next one loads. The module shares one
tensor-parallel engine; its tests run in order, and the last ones replace it."""
import psutil
import pytest
from IPython.core.error import UsageError

from dendrite_nb import Engine, SamplingParams
from dendrite_nb.magics import current_engine, current_session

from tests.support.engines import engine_state
from tests.support.notebook_session import PROMPT, install_in_session, magic

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)
POOL = "--num-blocks 48 --block-size 4"


def spy_on_loads(monkeypatch, record):
    """Engine.from_pretrained, recording record() at the moment each load starts."""
    load = Engine.from_pretrained
    seen = []

    def spied(*args, **kwargs):
        seen.append(record())
        return load(*args, **kwargs)

    monkeypatch.setattr(Engine, "from_pretrained", spied)
    return seen


@pytest.fixture(scope="module")
def split(shell, checkpoint):
    """The session holding a tensor-parallel engine loaded with `--tp 2 --replace` over a one-process one; what
    the load returned, and whether that one was closed when the new one started loading."""
    first = Engine.from_pretrained(checkpoint(), num_blocks=48, block_size=4)
    install_in_session(first)
    with pytest.MonkeyPatch.context() as monkeypatch:
        seen = spy_on_loads(monkeypatch, lambda: first.closed)
        loaded, _ = magic(shell, f"dendrite load {checkpoint()} --tp 2 {POOL} --replace")
    yield loaded, seen
    current_session().close_engine()   # no worker outlives this module


def worker_pid(engine: Engine) -> int:
    (worker,) = engine.tensor_workers
    return worker.pid


def test_load_closes_the_engine_first_and_says_where_the_ranks_run(shell, split):
    loaded, closed_when_loading = split
    engine = current_engine()
    assert closed_when_loading == [True]   # the one-process engine went before the workers started
    assert engine.tensor_parallel == 2
    (worker,) = engine.tensor_workers
    assert worker.rank == 1 and str(worker.device) == "cpu"
    assert worker.pid in {child.pid for child in psutil.Process().children()}
    ranks = (f"tensor parallel: 2 ranks: rank 0 on cpu (this kernel), rank 1 on cpu (pid {worker.pid}); "
             f"all-reduces over gloo")
    assert ranks in repr(loaded).splitlines()
    assert "(closed and freed the previous engine: Engine(" in repr(loaded)
    status, _ = magic(shell, "dendrite status")
    assert repr(status).splitlines()[1] == ranks


def test_it_generates_the_tokens_of_one_process(shell, split, checkpoint):
    magic(shell, "branch root", PROMPT + "\n")
    engine = current_engine()
    prompt = list(engine.branch("root").tokens)
    result, _ = magic(shell, "gen root -n 12 -t 0 --ignore-eos")
    assert [list(tokens) for tokens in result.tokens] == tokens_alone(checkpoint(), prompt, 12)


@pytest.mark.parametrize("line, message", [
    ("load {checkpoint} --tp 3 --replace", (r"tensor_parallel=3 cannot split this model .* heads \(4\), KV heads "
                                            r"\(2\).* This model runs at tensor_parallel 1, 2\.$")),
    ("load {checkpoint} --tp 0 --replace", "tensor_parallel must be an int >= 1"),
    ("load /no/such/folder --tp 2 --replace", "does not exist"),
    ("load {checkpoint} --tp 2 --device bogus --replace", "bogus"),
])
def test_a_request_that_cannot_run_is_refused_and_changes_nothing(shell, split, checkpoint, line, message):
    """A degree the model cannot be split by is the engine's error, checked before the loaded engine is closed:
    the session keeps it, exactly as it was, and its worker runs on."""
    engine = current_engine()
    before, pid = engine_state(engine), worker_pid(engine)
    with pytest.raises(UsageError, match=message):
        magic(shell, "dendrite " + line.format(checkpoint=checkpoint()))
    assert current_session().engine is engine and not engine.closed
    assert engine_state(engine) == before and worker_pid(engine) == pid and psutil.pid_exists(pid)
    engine.audit()


def test_the_demo_at_a_degree_its_model_cannot_take_is_refused(shell, split, real_gguf):
    """SmolLM2-135M has 9 heads and 3 KV heads: --tp 2 is refused, naming the degrees that work."""
    engine = current_engine()
    before = engine_state(engine)
    with pytest.raises(UsageError, match=r"KV heads \(3\).* runs at tensor_parallel 1, 3\.$"):
        magic(shell, "dendrite demo --tp 2 --replace")
    assert current_session().engine is engine and engine_state(engine) == before


def test_a_restore_that_cannot_run_is_refused_before_the_engine_is_closed(shell, split, checkpoint, tmp_path):
    """Restore's checks run before a tensor-parallel engine is closed for the restore (Engine.restore's
    before_build): a damaged save file, and a good one at a degree its model cannot be split by, are refused and
    the session keeps its engine, its worker running."""
    engine = current_engine()
    before, pid = engine_state(engine), worker_pid(engine)
    good = tmp_path / "good.dendrite"
    magic(shell, f"dendrite save {good}")
    damaged = tmp_path / "damaged.dendrite"
    damaged.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    for line, message in ((f"restore {damaged} --tp 2 --replace", "not a readable save file"),
                          (f"restore {good} --tp 3 --replace", r"tensor_parallel=3 cannot split")):
        with pytest.raises(UsageError, match=message):
            magic(shell, "dendrite " + line)
        assert current_session().engine is engine and not engine.closed
        assert engine_state(engine) == before and worker_pid(engine) == pid and psutil.pid_exists(pid)


def test_a_session_restores_at_tp_2(shell, split, checkpoint, tmp_path, monkeypatch):
    """`%dendrite restore FILE --tp 2 --replace`: the saved tree on a new tensor-parallel engine (the old one's
    worker ended first, once the file had passed its checks), which goes on decoding as one process would. The
    save file is read once: a session's KV can be gigabytes."""
    import dendrite_nb.persist as persist

    old_worker = psutil.Process(worker_pid(current_engine()))
    prompt = list(current_engine().branch("root").tokens)
    magic(shell, f"dendrite save {tmp_path / 's.dendrite'}")
    reads = []
    monkeypatch.setattr(persist, "read", lambda path, read=persist.read: reads.append(path) or read(path))
    loaded, _ = magic(shell, f"dendrite restore {tmp_path / 's.dendrite'} --tp 2 --replace")
    assert len(reads) == 1
    engine = current_engine()
    assert not old_worker.is_running() and engine.tensor_parallel == 2
    assert f"rank 1 on cpu (pid {worker_pid(engine)})" in repr(loaded)
    assert list(engine.branch("root").tokens) == prompt
    result, _ = magic(shell, "gen root -n 4 -t 0 --ignore-eos")
    assert [list(tokens) for tokens in result.tokens] == tokens_alone(checkpoint(), prompt, 4)


def test_a_load_that_fails_after_the_engine_was_closed_says_no_model_is_loaded(shell, split, checkpoint,
                                                                                monkeypatch):
    """Replacing a tensor-parallel engine closes it (its worker ended) before the new one loads; a load that
    fails after that (a pool larger than memory: only allocating finds it) says the session has no model now,
    and the next load works."""
    engine = current_engine()
    worker = psutil.Process(worker_pid(engine))
    seen = spy_on_loads(monkeypatch, worker.is_running)
    with pytest.raises(UsageError, match=r"num_blocks=.* \(The engine loaded before, Engine\(llama .*, 1 branch, .*\), "
                                         r"was closed first .* no model is loaded now\.\)$"):
        magic(shell, f"dendrite load {checkpoint()} --num-blocks {10**15} --replace")
    assert seen == [False] and engine.closed and current_session().engine is None
    with pytest.raises(UsageError, match="no model is loaded"):
        magic(shell, "gen root -n 1")
    loaded, _ = magic(shell, f"dendrite load {checkpoint()} {POOL}")
    assert current_engine().tensor_parallel == 1 and "tensor parallel" not in repr(loaded)


def test_an_engine_the_notebook_closed_itself_is_replaced_without_closing_it_again(shell, split, checkpoint):
    """`current_engine().close()` (which ends a tensor-parallel engine's workers) and then a load with --replace,
    or the kernel's shutdown, which closes the session's engine: a closed engine is not closed twice."""
    engine = current_engine()
    engine.close()
    loaded, _ = magic(shell, f"dendrite load {checkpoint()} {POOL} --replace")
    assert f"(closed and freed the previous engine: {engine!r})" in repr(loaded)
    current_engine().close()
    current_session().kernel_exiting()
    assert current_session().engine is None


def tokens_alone(folder, prompt: list[int], steps: int) -> list[list[int]]:
    """The greedy tokens of a single-process engine of the same checkpoint from `prompt`."""
    alone = Engine.from_pretrained(folder, num_blocks=48, block_size=4)
    try:
        alone.new_branch("root", prompt)
        return alone.generate(["root"], steps, GREEDY)
    finally:
        alone.close()
