// Building the page from the overview's JSON. Every value is put in as text (text nodes,
// textContent, setAttribute): nothing an agent or a worker reports is ever parsed as markup.

export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    node.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

export function bytes(n) {
  if (n === null || n === undefined) return "?";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  let v = Number(n);
  while (Math.abs(v) >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
  return `${v >= 100 || i === 0 ? v.toFixed(0) : v.toFixed(1)} ${units[i]}`;
}

function seconds(s) {
  if (s === null || s === undefined) return "–";
  return s < 1 ? `${Math.round(s * 1000)} ms` : `${s.toFixed(2)} s`;
}

export function ago(iso) {
  if (!iso) return "never";
  const t = Date.parse(iso);
  if (Number.isNaN(t)) return String(iso);
  const s = Math.max(0, Math.round((Date.now() - t) / 1000));
  if (s < 60) return `${s} s ago`;
  if (s < 3600) return `${Math.round(s / 60)} min ago`;
  return `${Math.round(s / 3600)} h ago`;
}

function badge(state) {
  return el("span", { class: "badge", "data-state": state }, state);
}

function reason(text) {
  return text ? el("pre", { class: "reason" }, text) : null;
}

function figure(label, value) {
  return el("div", { class: "figure" }, el("dt", {}, label), el("dd", {}, value));
}

function gpuBar(g) {
  const total = g.total || 1;
  const label = `GPU ${g.index} ${g.name}: ${bytes(g.total)} in all, fleet's servers ${bytes(g.fleet)}, ` +
    `others ${bytes(g.others)}, free ${bytes(g.free)}`;
  const bar = el("div", { class: "bar", role: "img", "aria-label": label });
  for (const part of ["fleet", "others", "free"]) {
    const seg = el("span", { class: `seg ${part}` });
    seg.style.width = `${(100 * g[part]) / total}%`;  // CSSOM, which the page's CSP allows
    bar.append(seg);
  }
  return el("div", { class: "gpu" },
    el("div", { class: "gpu-name" }, `GPU ${g.index} · ${g.name}`),
    bar,
    el("div", { class: "legend" },
      el("span", { class: "key fleet" }, `fleet ${bytes(g.fleet)}`), " ",
      el("span", { class: "key others" }, `others ${bytes(g.others)}`), " ",
      el("span", { class: "key free" }, `free ${bytes(g.free)} of ${bytes(g.total)}`)));
}

export function summary(s) {
  const st = s.statuses;
  const servers = Object.entries(s.servers).map(([k, v]) => `${v} ${k}`).join(", ") || "none";
  const g = s.gpus;
  return [
    el("div", { class: "tile", "data-state": st.offline ? "offline" : "online" },
      el("strong", {}, `${st.online + st.missed} of ${s.nodes}`), " nodes online",
      st.offline ? el("div", {}, `${st.offline} offline`) : null,
      st.missed ? el("div", {}, `${st.missed} missed a beat`) : null,
      st.unknown ? el("div", {}, `${st.unknown} not asked yet`) : null),
    el("div", { class: "tile" }, el("strong", {}, String(s.clusters)), " clusters", el("div", {}, `servers: ${servers}`)),
    el("div", { class: "tile" }, el("strong", {}, String(g.count)), " GPUs",
      g.count ? el("div", {}, `${bytes(g.free)} free of ${bytes(g.total)}`) : null),
    el("div", { class: "tile", "data-state": s.alerts_open ? "failed" : "running" },
      el("strong", {}, String(s.alerts_open)), " open alerts",
      s.drift ? el("div", {}, "drift: ", s.drift_summary) : el("div", {}, "the fleet matches its file")),
  ];
}

export function node(n) {
  const card = el("article", { class: "card node", "data-node": n.name, "data-status": n.status,
    "aria-label": `node ${n.name}, ${n.status}` });
  card.append(el("h3", {}, n.name, " ", badge(n.status)));
  const facts = el("dl", { class: "facts" },
    figure("address", n.address),
    figure("last heartbeat", n.last_seen ? `${ago(n.last_seen)} (${n.last_seen})` : "never"));
  if (n.cores) {
    const a = n.availability;
    facts.append(
      figure("window", a.windows.length ? `${a.windows.join(", ")} (${a.inside ? "inside now" : "outside now"})`
        : "always available"),
      figure("cores", `${n.cores.usable ?? "?"} of ${n.cores.logical ?? "?"}`),
      figure("memory", `${bytes(n.memory.available)} free of ${bytes(n.memory.total)}`),
      figure("disk", `${bytes(n.disk.free)} free of ${bytes(n.disk.total)}` +
        (n.disk.reserve ? ` (${bytes(n.disk.reserve)} kept free)` : "")),
      figure("agent", `${n.agent_version} · ${n.accelerator}${n.simulated ? " · simulated GPUs" : ""}`));
  }
  card.append(facts);
  if (n.error) card.append(el("p", { class: "error" }, "why: "), reason(n.error));
  for (const g of n.gpus || []) card.append(gpuBar(g));
  if (n.holds && n.holds.length) {
    card.append(el("h4", {}, "Holds"), el("ul", { class: "list" }, n.holds.map((w) => el("li", {},
      `${w.model} (${w.format}, ${bytes(w.bytes)}${w.whole ? "" : `, layers ${w.layers}`}) `,
      badge(w.verification), w.key_missing ? ` key ${w.key_missing} missing` : null,
      w.corrupt ? reason(w.corrupt) : null))));
  }
  if (n.runs && n.runs.length) {
    card.append(el("h4", {}, "Runs"), el("ul", { class: "list" }, n.runs.map((s) => el("li", { "data-server": s.id },
      `${s.id} · ${s.model} · port ${s.port} `, badge(s.state), reason(s.reason)))));
  }
  if (n.fetches && n.fetches.length) {
    card.append(el("h4", {}, "Fetching"), el("ul", { class: "list" }, n.fetches.map(fetchLine)));
  }
  return card;
}

function fetchLine(f) {
  const pct = f.bytes_total ? Math.floor((100 * f.bytes_done) / f.bytes_total) : 0;
  return el("li", { class: "fetch" }, `${f.node}: ${f.model || f.digest.slice(0, 19)}${f.layers ? ` layers ${f.layers}` : ""}`,
    ` from ${f.peer || "?"} · ${bytes(f.bytes_done)} of ${bytes(f.bytes_total)} · ${bytes(f.rate)}/s `,
    el("progress", { max: 100, value: pct, "aria-label": `${pct}%` }), " ", badge(f.state), reason(f.error));
}

export function cluster(c) {
  const t = c.traffic;
  const card = el("article", { class: "card cluster", "data-cluster": c.name },
    el("h3", {}, c.name, " ", badge(c.serving ? "serving" : "not serving")),
    el("dl", { class: "facts" },
      figure("model", c.model), figure("port", String(c.port)),
      figure("members", Object.entries(c.states).map(([k, v]) => `${v} ${k}`).join(", ")),
      figure("requests", `${t.requests_per_s.toFixed(2)}/s (${t.requests} since start)`),
      figure("tokens", `${t.tokens_per_s.toFixed(1)}/s`),
      figure("latency", `p50 ${seconds(t.p50_s)} · p99 ${seconds(t.p99_s)}`),
      t.errors_per_s ? figure("errors", `${t.errors_per_s.toFixed(2)}/s`) : null));
  card.append(el("ul", { class: "list" }, c.members.map((m) => el("li", { "data-member": m.id },
    `${m.node} `, badge(m.state), reason(m.state === "running" ? null : m.reason)))));
  if (c.members_total > c.members.length) card.append(el("p", {}, `and ${c.members_total - c.members.length} more`));
  return card;
}

export function model(m) {
  return el("article", { class: "card model", "data-model": m.name },
    el("h3", {}, m.name, m.undeclared ? " (not in the fleet file)" : "", " ",
      m.corrupt ? badge("corrupt") : null),
    el("p", {}, `${m.format} · held by ${m.holders_total} node${m.holders_total === 1 ? "" : "s"}`),
    el("ul", { class: "list" }, m.holders.map((h) => el("li", {},
      `${h.node}: ${h.layers ? `layers ${h.layers}` : "whole"} `, badge(h.verification),
      h.key_missing ? ` key ${h.key_missing} missing` : null, reason(h.corrupt)))));
}

export function replications(w) {
  if (!w.replications.length) return [el("p", {}, "none")];
  const out = [el("ul", { class: "list" }, w.replications.map(fetchLine))];
  if (w.replications_total > w.replications.length) out.push(el("p", {}, `and ${w.replications_total - w.replications.length} more`));
  return out;
}

export function alerts(list) {
  if (!list.length) return [el("p", {}, "no alerts")];
  return [el("ul", { class: "list alerts" }, list.map((a) => el("li", { "data-alert": a.kind, "data-open": a.cleared_at ? "no" : "yes" },
    badge(a.cleared_at ? "cleared" : "open"), ` ${a.kind} · ${a.node} · raised ${a.raised_at}`,
    a.cleared_at ? `, cleared ${a.cleared_at}` : "", reason(a.cause))))];
}

export function applies(list) {
  if (!list.length) return [el("p", {}, "no apply recorded")];
  return [el("ul", { class: "list" }, list.map((a) => el("li", {},
    badge(a.outcome), ` ${a.finished || a.started} · ${a.summary} · ${a.actions} actions` +
    (a.failed ? `, ${a.failed} failed` : "") + (a.skipped ? `, ${a.skipped} skipped` : ""),
    a.failures.map((f) => reason(`${f.action} ${f.address}: ${f.code || ""} ${f.message}`))))) ];
}
