// ThroughputView front end: tokens/s, step time and batch size per decode step, with plotly.js.
// plotly.js comes from the kernel's plotly package through a shared model (see plotly_library.py),
// loaded once per page; nothing is fetched from the network.
const MARKER_LIMIT = 2000;   // above this many steps, lines only: markers would cost more than they show


function loadPlotly(model) {
  if (window.Plotly) return Promise.resolve(window.Plotly);
  if (!window.__dendritePlotly) {
    window.__dendritePlotly = (async () => {
      const reference = model.get("_plotly");   // "IPY_MODEL_<id>"
      const library = await model.widget_manager.get_model(reference.replace(/^IPY_MODEL_/, ""));
      const url = URL.createObjectURL(new Blob([library.get("_source")], { type: "text/javascript" }));
      try {
        await import(url);   // the bundle sets window.Plotly
      } finally {
        URL.revokeObjectURL(url);
      }
      return window.Plotly;
    })();
    window.__dendritePlotly.catch(() => { window.__dendritePlotly = null; });
  }
  return window.__dendritePlotly;
}


async function render({ model, el }) {
  const frame = viewFrame(el, "throughput");
  const root = frame.root;
  const plot = element("div", "dendrite-throughput");
  plot.style.width = "100%";
  plot.style.height = "360px";
  root.append(plot);

  let Plotly;
  try {
    Plotly = await loadPlotly(model);
  } catch (failure) {
    frame.error.textContent = `plotly.js could not be loaded: ${failure}`;
    return;
  }

  function draw() {
    const stepSeconds = typed(Float64Array, model.get("_step_s"));
    const batchSizes = typed(Uint32Array, model.get("_batch_sizes"));
    showStatus(model, frame);
    const steps = Array.from(stepSeconds, (_, i) => i);
    const tokensPerSecond = Array.from(stepSeconds, (s, i) => (s > 0 ? batchSizes[i] / s : null));
    const stepMs = Array.from(stepSeconds, (s) => 1e3 * s);
    const mode = steps.length <= MARKER_LIMIT ? "lines+markers" : "lines";
    const fg = cssColour(root, "--dendrite-fg", "#1f1f1f");
    const grid = cssColour(root, "--dendrite-border", "#d0d0d0");
    const axis = (title) => ({ title: { text: title }, gridcolor: grid, zerolinecolor: grid, rangemode: "tozero" });
    const data = [
      { x: steps, y: tokensPerSecond, name: "tokens/s", mode, marker: { size: 4 }, yaxis: "y",
        hovertemplate: "step %{x}: %{y:,.0f} tok/s<extra></extra>" },
      { x: steps, y: stepMs, name: "step ms", mode: "lines", yaxis: "y2",
        hovertemplate: "step %{x}: %{y:.2f} ms<extra></extra>" },
      { x: steps, y: Array.from(batchSizes), name: "batch", mode: "lines", line: { shape: "hv" }, yaxis: "y3",
        hovertemplate: "step %{x}: %{y} branches<extra></extra>" },
    ];
    const layout = {
      margin: { l: 60, r: 10, t: 10, b: 36 }, showlegend: false,
      paper_bgcolor: "rgba(0,0,0,0)", plot_bgcolor: "rgba(0,0,0,0)", font: { color: fg, size: 11 },
      grid: { rows: 3, columns: 1, subplots: [["xy"], ["xy2"], ["xy3"]], roworder: "top to bottom" },
      xaxis: { title: { text: `decode step (generation ${model.get("_call")})` }, gridcolor: grid, zerolinecolor: grid },
      yaxis: axis("tokens/s"), yaxis2: axis("step ms"), yaxis3: axis("batch"),
    };
    Plotly.react(plot, data, layout, { displaylogo: false, responsive: true });
  }

  const schedule = oncePerFrame(draw);
  const events = "change:_step_s change:_batch_sizes change:_summary change:_error change:_call";
  model.on(events, schedule);
  const themeWatch = new MutationObserver(schedule);
  themeWatch.observe(document.body, { attributes: true, attributeFilter: ["data-jp-theme-light", "data-jp-theme-name"] });
  draw();
  return () => { model.off(events, schedule); themeWatch.disconnect(); Plotly.purge(plot); };
}

export default { render };
