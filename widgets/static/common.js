// Helpers shared by the three views. anywidget loads each view's `_esm` as one module and there is
// no bundler, so Python prepends this file to each view's source (widgets/engine_view.py).

// A binary trait (a DataView) as a typed array; copied, because the buffer's offset may not be aligned.
function typed(Kind, view) {
  if (!view || view.byteLength === 0) return new Kind(0);
  return new Kind(view.buffer.slice(view.byteOffset, view.byteOffset + view.byteLength));
}

function element(tag, className) {
  const made = document.createElement(tag);
  if (className) made.className = className;
  return made;
}

// The parts every view has: its root, a summary line and an error line (empty unless updates fail).
function viewFrame(el, kind) {
  const root = element("div", `dendrite-view dendrite-${kind}-view`);
  const summary = element("div", "dendrite-summary");
  const error = element("div", "dendrite-error");
  root.append(summary, error);
  el.appendChild(root);
  return { root, summary, error };
}

function showStatus(model, { summary, error }) {
  summary.textContent = model.get("_summary");
  error.textContent = model.get("_error") ? `not updating: ${model.get("_error")}` : "";
}

// Backbone fires one change:* event per trait of a message; run `draw` once per frame instead.
function oncePerFrame(draw) {
  let queued = false;
  return () => {
    if (queued) return;
    queued = true;
    requestAnimationFrame(() => { queued = false; draw(); });
  };
}

function cssColour(node, name, fallback = "") {
  return getComputedStyle(node).getPropertyValue(name).trim() || fallback;
}

function showTooltip(tooltip, text, event) {
  tooltip.textContent = text;
  tooltip.style.display = "block";
  tooltip.style.left = `${event.clientX + 12}px`;
  tooltip.style.top = `${event.clientY + 12}px`;
}

