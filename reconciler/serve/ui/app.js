// The status page: the overview pushed by GET /ui/api/events (server-sent events) whenever the
// heartbeat's view changes, drawn by render.js; the node list's filter and page are the stream's
// query, so changing them opens a new stream.

import * as render from "./render.js";
import { playground } from "./playground.js";

const $ = (id) => document.getElementById(id);
const state = { page: 0, q: "", status: "", source: null, last: null };

function params() {
  const p = new URLSearchParams();
  if (state.page) p.set("page", String(state.page));
  if (state.q) p.set("q", state.q);
  if (state.status) p.set("status", state.status);
  return p.toString();
}

function live(text, kind) {
  const badge = $("live");
  badge.textContent = text;
  badge.dataset.state = kind;
}

function draw(o) {
  state.last = o;
  $("logout").hidden = !o.auth;
  $("summary").replaceChildren(...render.summary(o.summary));
  const n = o.nodes;
  $("node-list").replaceChildren(...(n.items.length ? n.items.map(render.node) : [render.el("p", {}, "no node matches")]));
  state.page = n.page;
  $("page-info").textContent = `page ${n.page + 1} of ${n.pages} · ${n.total} node${n.total === 1 ? "" : "s"}`;
  $("prev").disabled = n.page <= 0;
  $("next").disabled = n.page >= n.pages - 1;
  $("pager").hidden = n.pages <= 1;
  const more = o.clusters_total > o.clusters.length
    ? [render.el("p", { class: "more" }, `${o.clusters.length} of ${o.clusters_total} clusters shown: those not wholly running first`)] : [];
  $("cluster-list").replaceChildren(...(o.clusters.length ? o.clusters.map(render.cluster) : [render.el("p", {}, "no clusters")]), ...more);
  $("weight-list").replaceChildren(...o.weights.models.map(render.model));
  $("replication-list").replaceChildren(...render.replications(o.weights));
  $("alert-list").replaceChildren(...render.alerts(o.alerts));
  $("apply-list").replaceChildren(...render.applies(o.applies));
  pg.clusters(o.cluster_names, o.auth);
  live(`live · beat ${o.summary.beats} · ${new Date().toLocaleTimeString()}`, "live");
}

async function refused() {
  // An event stream that fails says nothing about why: ask the data once to tell a lost key from a lost server.
  try {
    const r = await fetch(`/ui/api/overview?${params()}`, { credentials: "same-origin" });
    if (r.status === 401) { window.location.assign("/ui"); return true; }
  } catch (e) { /* the server is away: the stream retries */ }
  return false;
}

function connect() {
  if (state.source) state.source.close();
  const source = new EventSource(`/ui/api/events?${params()}`);
  state.source = source;
  source.addEventListener("overview", (e) => draw(JSON.parse(e.data)));
  source.addEventListener("error", async () => {
    live("reconnecting…", "lost");
    if (source.readyState === EventSource.CLOSED && !(await refused())) setTimeout(connect, 2000);
  });
}

let typing = null;
$("q").addEventListener("input", () => {
  clearTimeout(typing);
  typing = setTimeout(() => { state.q = $("q").value.trim(); state.page = 0; connect(); }, 250);
});
$("filters").addEventListener("submit", (e) => e.preventDefault());
$("status").addEventListener("change", () => { state.status = $("status").value; state.page = 0; connect(); });
$("prev").addEventListener("click", () => { state.page = Math.max(0, state.page - 1); connect(); });
$("next").addEventListener("click", () => { state.page += 1; connect(); });

const pg = playground({
  form: $("ask"), cluster: $("pg-cluster"), prompt: $("pg-prompt"), max: $("pg-max"), key: $("pg-key"),
  keyLabel: $("pg-key-label"), send: $("pg-send"), stop: $("pg-stop"), answer: $("pg-answer"), stats: $("pg-stats"),
});
connect();
