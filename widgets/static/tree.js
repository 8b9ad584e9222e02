// TreeView front end: a tidy tree (leaves on consecutive rows, each parent centred on its children),
// depth left to right. Collapsing a node hides its subtree; clicking a node selects its branch.
const SVG = "http://www.w3.org/2000/svg";
const ROW_PX = 22;
const COLUMN_PX = 130;
const MARGIN_PX = 24;

function svg(tag, attributes, parent) {
  const made = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attributes)) made.setAttribute(key, value);
  if (parent) parent.appendChild(made);
  return made;
}
function radius(numTokens) {
  return Math.min(12, 3 + 0.6 * Math.sqrt(numTokens));
}

// Rows and depths for the visible nodes. Returns Map id -> {row, depth}.
function layout(nodes, children, collapsed) {
  const placed = new Map();
  let nextRow = 0;
  function place(id, depth) {
    const kids = collapsed.has(id) ? [] : children.get(id) || [];
    if (kids.length === 0) {
      placed.set(id, { row: nextRow++, depth });
      return;
    }
    for (const kid of kids) place(kid, depth + 1);
    const first = placed.get(kids[0]).row;
    const last = placed.get(kids[kids.length - 1]).row;
    placed.set(id, { row: (first + last) / 2, depth });
  }
  const root = nodes.find((n) => n.parent === null);
  if (root) place(root.id, 0);
  return { placed, rows: nextRow };
}

function tooltipText(node, blocks, refcounts) {
  const ids = Array.from(blocks.slice(0, 24));
  const refs = Array.from(refcounts.slice(0, 24));
  const more = blocks.length > 24 ? ` … (+${blocks.length - 24})` : "";
  const lines = [
    node.parent === null ? "root" : `node ${node.id}`,
    `branches: ${node.branches.join(", ") || "none (shared prefix)"}`,
    `state: ${node.state}`,
    `tokens: ${node.num_tokens.toLocaleString()} at positions ${node.start.toLocaleString()}–${(node.start + node.num_tokens).toLocaleString()}`,
    `blocks: ${ids.join(", ") || "none"}${more}`,
    `refcounts: ${refs.join(", ") || "–"}${more}`,
  ];
  if (node.mean_logprob !== null && node.mean_logprob !== undefined) {
    lines.push(`mean logprob: ${node.mean_logprob.toFixed(3)} (its sampled tokens)`);
  }
  for (const constraint of node.constraints || []) lines.push(`constraint ${constraint}`);
  if (node.tail) lines.push(`…${node.tail}`);
  return lines.join("\n");
}

function render({ model, el }) {
  const frame = viewFrame(el, "tree");
  const legend = element("div", "dendrite-legend");
  for (const state of ["idle", "decoding", "finished", "preempted", "shared"]) {
    const item = element("span");
    item.innerHTML = `<span class="dendrite-swatch" style="border-radius:50%;background:var(--dendrite-state-${state})"></span>${state === "shared" ? "shared prefix" : state}`;
    legend.appendChild(item);
  }
  const scroll = element("div", "dendrite-scroll");
  const tooltip = element("div", "dendrite-tooltip");
  frame.root.append(legend, scroll, tooltip);

  const collapsed = new Set();   // per view: two displays of one model may fold differently

  function draw() {
    const nodes = model.get("_nodes");
    const offsets = typed(Int32Array, model.get("_block_offsets"));
    const blocks = typed(Int32Array, model.get("_blocks"));
    const refcounts = typed(Uint16Array, model.get("_refcounts"));
    const selected = model.get("selected");
    showStatus(model, frame);

    const children = new Map();
    const index = new Map();
    nodes.forEach((node, i) => {
      index.set(node.id, i);
      if (node.parent !== null) {
        if (!children.has(node.parent)) children.set(node.parent, []);
        children.get(node.parent).push(node.id);
      }
    });
    const { placed, rows } = layout(nodes, children, collapsed);
    const depth = Math.max(0, ...Array.from(placed.values(), (p) => p.depth));
    const width = MARGIN_PX * 2 + depth * COLUMN_PX + 160;
    const height = MARGIN_PX + rows * ROW_PX;
    const x = (p) => MARGIN_PX + p.depth * COLUMN_PX;
    const y = (p) => MARGIN_PX / 2 + p.row * ROW_PX + ROW_PX / 2;

    const canvas = svg("svg", { width, height, class: "dendrite-tree" });
    const edges = svg("g", {}, canvas);
    const marks = svg("g", {}, canvas);
    for (const node of nodes) {
      const at = placed.get(node.id);
      if (!at) continue;   // inside a collapsed subtree
      if (node.parent !== null) {
        const from = placed.get(node.parent);
        const midX = (x(from) + x(at)) / 2;
        svg("path", { class: "dendrite-edge", d: `M${x(from)},${y(from)} C${midX},${y(from)} ${midX},${y(at)} ${x(at)},${y(at)}` }, edges);
      }
      const i = index.get(node.id);
      const group = svg("g", {
        class: "dendrite-node", transform: `translate(${x(at)},${y(at)})`,
        "data-node-id": node.id, "data-state": node.state,
        "data-selected": String(selected !== null && node.branches.includes(selected)),
      }, marks);
      svg("circle", { r: radius(node.num_tokens), fill: `var(--dendrite-state-${node.state})` }, group);
      const label = svg("text", { x: radius(node.num_tokens) + 4, y: 4, class: "dendrite-label" }, group);
      label.textContent = node.label;
      const kids = children.get(node.id) || [];
      if (kids.length) {
        const toggle = svg("text", { x: -radius(node.num_tokens) - 11, y: 4, class: "dendrite-toggle" }, group);
        toggle.textContent = collapsed.has(node.id) ? "▸" : "▾";
        toggle.addEventListener("click", (event) => {
          event.stopPropagation();
          collapsed.has(node.id) ? collapsed.delete(node.id) : collapsed.add(node.id);
          draw();
        });
      }
      group.addEventListener("click", () => {
        if (!node.branches.length) return;
        const current = node.branches.indexOf(model.get("selected"));
        model.set("selected", node.branches[(current + 1) % node.branches.length]);
        model.save_changes();
      });
      group.addEventListener("mousemove", (event) => showTooltip(tooltip, tooltipText(
        node, blocks.subarray(offsets[i], offsets[i + 1]), refcounts.subarray(offsets[i], offsets[i + 1])), event));
      group.addEventListener("mouseleave", () => { tooltip.style.display = "none"; });
    }
    scroll.replaceChildren(canvas);
  }

  const events = "change:_nodes change:_blocks change:selected change:_summary change:_error";
  const schedule = oncePerFrame(draw);
  model.on(events, schedule);
  draw();
  return () => model.off(events, schedule);
}

export default { render };
