// BlockTableView front end: one canvas cell per physical KV block, coloured by readers.
// A canvas keeps a 100,000-block pool to one paint of a few milliseconds, where one element per
// block would stall the page. The canvas carries its geometry in data-* attributes so a test (or a
// user's own script) can find block i at column i % columns, row floor(i / columns).
const READER_BUCKETS = 5;   // colours for 1, 2, 3, 4 and 5+ readers

function cellPixels(numBlocks) {
  if (numBlocks <= 4096) return 10;
  if (numBlocks <= 16384) return 6;
  return 3;
}
// A CSS colour as one little-endian RGBA word of ImageData. The canvas normalises any CSS colour
// syntax to "#rrggbb" or "rgba(r, g, b, a)" when it is assigned as a fill style.
function packed(context, css) {
  context.fillStyle = css;
  const value = context.fillStyle;
  const [r, g, b, a] = value.startsWith("#")
    ? [1, 3, 5].map((i) => parseInt(value.slice(i, i + 2), 16)).concat(255)
    : value.match(/[\d.]+/g).map(Number).map((v, i) => (i === 3 ? Math.round(v * 255) : v));
  return ((a << 24) | (b << 16) | (g << 8) | r) >>> 0;
}

function render({ model, el }) {
  const frame = viewFrame(el, "blocks");
  const root = frame.root;
  const legend = element("div", "dendrite-legend");
  const swatch = (attributes, style, text) => {
    const item = element("span");
    const mark = element("span", "dendrite-swatch");
    for (const [key, value] of Object.entries(attributes)) mark.setAttribute(key, value);
    mark.setAttribute("style", style);
    item.append(mark, text);
    legend.appendChild(item);
  };
  swatch({ "data-readers": "0" }, "background:var(--dendrite-free)", "free");
  for (let r = 1; r <= READER_BUCKETS; r++) {
    swatch({ "data-readers": String(r) }, `background:var(--dendrite-readers-${r})`,
           `${r}${r === READER_BUCKETS ? "+" : ""} branch${r === 1 ? "" : "es"}`);
  }
  swatch({}, "background:transparent;border:2px solid var(--dendrite-selected)", "selected branch");
  swatch({}, "background:linear-gradient(135deg, var(--dendrite-copy) 50%, transparent 50%)", "copy-on-write copy");
  const scroll = element("div", "dendrite-scroll");
  const canvas = element("canvas", "dendrite-blocks");
  scroll.appendChild(canvas);
  const tooltip = element("div", "dendrite-tooltip");
  root.append(legend, scroll, tooltip);

  let data = null;
  function read() {
    data = {
      numBlocks: model.get("_num_blocks"),
      blockSize: model.get("_block_size"),
      readers: typed(Uint16Array, model.get("_readers")),
      refcounts: typed(Uint16Array, model.get("_refcounts")),
      nodes: typed(Int32Array, model.get("_nodes")),
      logical: typed(Int32Array, model.get("_logical")),
      filled: typed(Uint16Array, model.get("_filled")),
      copies: typed(Uint8Array, model.get("_copy_on_write")),
      selectedBlocks: typed(Int32Array, model.get("_selected_blocks")),
    };
    showStatus(model, frame);
  }

  function paint() {
    const started = performance.now();
    const { numBlocks, readers, copies, selectedBlocks } = data;
    const cell = cellPixels(numBlocks);
    const gap = cell >= 6 ? 1 : 0;
    const pitch = cell + gap;
    const widthPx = Math.max(200, Math.min(scroll.clientWidth || 800, 1200));
    const columns = Math.max(1, Math.floor(widthPx / pitch));
    const rows = Math.max(1, Math.ceil(numBlocks / columns));
    const ratio = window.devicePixelRatio || 1;
    canvas.style.width = `${columns * pitch}px`;
    canvas.style.height = `${rows * pitch}px`;
    canvas.width = Math.round(columns * pitch * ratio);
    canvas.height = Math.round(rows * pitch * ratio);
    Object.assign(canvas.dataset, { columns, pitch, cell, numBlocks });
    const context = canvas.getContext("2d");
    context.setTransform(ratio, 0, 0, ratio, 0, 0);

    // Cells are written straight into one ImageData (device pixels) and put once: a 100,000-block pool
    // is one pass over memory instead of 100,000 fillRect calls.
    const palette = Array.from({ length: READER_BUCKETS + 1 }, (_, bucket) =>
      packed(context, cssColour(root, bucket === 0 ? "--dendrite-free" : `--dendrite-readers-${bucket}`)));
    const image = context.createImageData(canvas.width, canvas.height);
    const words = new Uint32Array(image.data.buffer);
    const side = Math.max(1, Math.round(cell * ratio));
    for (let i = 0; i < numBlocks; i++) {
      const colour = palette[Math.min(readers[i], READER_BUCKETS)];
      const left = Math.round((i % columns) * pitch * ratio), top = Math.round(Math.floor(i / columns) * pitch * ratio);
      for (let y = top; y < top + side; y++) words.fill(colour, y * canvas.width + left, y * canvas.width + left + side);
    }
    context.putImageData(image, 0, 0);
    context.fillStyle = cssColour(root, "--dendrite-copy");
    const corner = Math.max(2, Math.floor(cell / 2));
    for (let i = 0; i < numBlocks; i++) {
      if (!copies[i]) continue;
      const left = (i % columns) * pitch, top = Math.floor(i / columns) * pitch;
      context.beginPath();
      context.moveTo(left, top);
      context.lineTo(left + corner, top);
      context.lineTo(left, top + corner);
      context.fill();
    }
    context.strokeStyle = cssColour(root, "--dendrite-selected");
    context.lineWidth = cell >= 6 ? 1.5 : 1;
    for (const i of selectedBlocks) {
      context.strokeRect((i % columns) * pitch + 0.5, Math.floor(i / columns) * pitch + 0.5, cell - 1, cell - 1);
    }
    canvas.dataset.paintMs = (performance.now() - started).toFixed(1);   // how smooth a large pool stays
  }

  function describe(i) {
    if (data.nodes[i] < 0) return `block ${i}: free`;
    const lines = [
      `block ${i}`,
      `node ${data.nodes[i]}, logical block ${data.logical[i]} (tokens ${data.logical[i] * data.blockSize}–${data.logical[i] * data.blockSize + data.filled[i] - 1})`,
      `${data.filled[i]} of ${data.blockSize} slots filled`,
      `read by ${data.readers[i]} branch${data.readers[i] === 1 ? "" : "es"}, refcount ${data.refcounts[i]}`,
    ];
    if (data.copies[i]) lines.push("a copy-on-write copy of its parent's partial block");
    if (data.selectedBlocks.includes(i)) lines.push(`in ${model.get("selected")}'s block table`);
    return lines.join("\n");
  }

  canvas.addEventListener("mousemove", (event) => {
    const box = canvas.getBoundingClientRect();
    const pitch = Number(canvas.dataset.pitch), columns = Number(canvas.dataset.columns);
    const column = Math.floor((event.clientX - box.left) / pitch), row = Math.floor((event.clientY - box.top) / pitch);
    const i = row * columns + column;
    if (column >= columns || i >= data.numBlocks) { tooltip.style.display = "none"; return; }
    showTooltip(tooltip, describe(i), event);
  });
  canvas.addEventListener("mouseleave", () => { tooltip.style.display = "none"; });

  const update = oncePerFrame(() => { read(); paint(); });
  const events = "change:_readers change:_nodes change:_copy_on_write change:_selected_blocks change:_num_blocks change:_summary change:_error";
  model.on(events, update);
  // Theme switches change the CSS colours the canvas was painted with.
  const themeWatch = new MutationObserver(paint);
  themeWatch.observe(document.body, { attributes: true, attributeFilter: ["data-jp-theme-light", "data-jp-theme-name"] });
  const resizeWatch = new ResizeObserver(() => paint());
  resizeWatch.observe(scroll);
  read();
  paint();
  return () => { model.off(events, update); themeWatch.disconnect(); resizeWatch.disconnect(); };
}

export default { render };
