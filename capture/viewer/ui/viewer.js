"use strict";
const PAGE = 2000;
const LIST_PAGE = 100;
const state = { token: "", session: null, data: null, row: null, calls: [], pages: new Map(), observer: null, gen: 0, nav: 0, listed: false,
  list: { sort: "", order: "desc", filters: [], q: "", offset: 0, keys: [], sortUsed: "" }, run: null, runBy: "", live: false };
const $ = (sel) => document.querySelector(sel);
const PROV = ["prompt", "sampled", "recomputed", "stale"];
const { plot, strip, fmtNum, statusColour, SPARE } = window.agenttapPlots;

// Where the page is lives in its address: #session=ID (a session), #session=ID&row=THREAD_ID
// (a row), nothing (the list), so links, Back and a reload go where they say.
function hashParams() {
  const out = new Map();
  for (const part of location.hash.replace(/^#/, "").split("&")) {
    if (!part) continue;
    const i = part.indexOf("=");
    const k = i < 0 ? part : part.slice(0, i), v = i < 0 ? "" : part.slice(i + 1);
    try { out.set(decodeURIComponent(k), decodeURIComponent(v)); } catch (e) { out.set(k, v); }
  }
  return out;
}

function hashOf(params) {
  return [...params].map(([k, v]) => encodeURIComponent(k) + "=" + encodeURIComponent(v)).join("&");
}

function sessionHref(sid) { return "#" + hashOf([["session", sid]]); }
function groupHref(gid) { return "#" + hashOf([["group", gid]]); }
function rowHref(sid, tid) { return "#" + hashOf([["session", sid], ["row", tid]]); }

// The token comes in the address (/ui/#token=TOKEN): kept for the tab, taken out of the address.
function takeToken() {
  const params = hashParams();
  if (params.has("token")) {
    sessionStorage.setItem("agenttap-token", params.get("token"));
    params.delete("token");
    const rest = hashOf(params);
    history.replaceState(null, "", location.pathname + location.search + (rest ? "#" + rest : ""));
  }
  const before = state.token;
  state.token = sessionStorage.getItem("agenttap-token") || "";
  return state.token !== before;
}

async function api(path) {
  const headers = state.token ? { Authorization: "Bearer " + state.token } : {};
  const resp = await fetch("api/" + path, { headers });
  const body = await resp.json().catch(() => ({}));
  if (!resp.ok) {
    let msg = (body.error && body.error.message) || resp.statusText;
    if (resp.status === 401 || resp.status === 403) {
      msg += "\nOpen this page as /ui/#token=TOKEN (the AGENTTAP_TOKEN= line of the proxy's log).";
    }
    throw new Error(msg);
  }
  return body;
}

function showError(err) { $("#error").textContent = err ? String(err.message || err) : ""; }

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const c of children) {
    if (c === null || c === undefined) continue;
    node.append(c instanceof Node ? c : String(c));
  }
  return node;
}

// A reward as a researcher reads it: 3 significant digits (0.290, not 0.29032258064516...).
function fmtReward(r) {
  if (r === null || r === undefined) return "";
  if (Array.isArray(r)) return r.map(fmtNum).join(", ");
  return fmtNum(r);
}

function fmtSigned(x) {
  if (x === null || x === undefined) return "";
  return (x > 0 ? "+" : "") + fmtNum(x);
}

function metaText(meta) {
  if (!meta) return "";
  if (typeof meta !== "object") return String(meta);
  return Object.entries(meta).map(([k, v]) => k + "=" + (typeof v === "object" ? JSON.stringify(v) : v)).join("  ");
}

function markSelected() {
  for (const tr of document.querySelectorAll("tr.session")) tr.classList.toggle("selected", tr.dataset.session === state.session);
}

// -- the session list: a page at a time, sorted and filtered by the server ------------------
const FIELDS = [["", "default"], ["trainer_step", "trainer_step"], ["reward", "reward"], ["started_at", "started"], ["calls", "calls"],
  ["tokens", "tokens"], ["trained_tokens", "trained tokens"], ["status", "status"], ["version", "weight version"], ["id", "id"]];
const OWN = new Set(["id", "status", "reward", "rows", "calls", "tokens", "trained_tokens", "end_reason", "started_at", "ended_at", "version"]);

function listQuery() {
  const l = state.list, q = new URLSearchParams();
  if (l.sort) q.set("sort", l.sort);
  q.set("order", l.order);
  for (const [k, v] of l.filters) q.append("filter", k + "=" + v);
  if (l.q) q.set("q", l.q);
  q.set("offset", l.offset);
  q.set("limit", LIST_PAGE);
  return q.toString();
}

function keyValue(s, key) {
  if (key === "reward") return fmtReward(s.reward);
  if (key === "version") return s.versions.length ? s.versions[s.versions.length - 1] : "";
  if (key === "started_at" || key === "ended_at") return s[key] ? new Date(s[key] * 1000).toISOString().slice(5, 19).replace("T", " ") : "";
  if (OWN.has(key)) return s[key] ?? "";
  const v = s.metadata && typeof s.metadata === "object" ? s.metadata[key] : undefined;
  return v === undefined || v === null ? "" : typeof v === "object" ? JSON.stringify(v) : String(v);
}

function renderListControls(data) {
  const sort = $("#sort");
  const have = new Set(FIELDS.map(([k]) => k));
  const options = FIELDS.map(([k, label]) => [k, label]).concat(data.keys.filter((k) => !have.has(k.key)).map((k) => [k.key, k.key + " (metadata)"]));
  sort.replaceChildren(...options.map(([k, label]) => el("option", { value: k }, label)));
  sort.value = state.list.sort;
  $("#order").value = state.list.order;
  const fk = $("#filter-key");
  const chosen = fk.value;
  fk.replaceChildren(el("option", { value: "" }, "key…"), el("option", { value: "status" }, "status"),
    ...data.keys.map((k) => el("option", { value: k.key }, k.key + " (" + k.distinct + ")")));
  fk.value = chosen;
  state.list.keys = data.keys;
  $("#filters").replaceChildren(...state.list.filters.map(([k, v], i) => el("span", { class: "chip", "data-key": k }, k + "=" + v,
    el("button", { title: "remove", onclick: () => { state.list.filters.splice(i, 1); state.list.offset = 0; refreshList(); } }, "×"))));
  const shown = data.sessions.length;
  $("#list-count").textContent = data.matched === data.total ? data.total + " sessions" : data.matched + " of " + data.total + " sessions match";
  $("#page-info").textContent = shown ? (data.offset + 1) + "–" + (data.offset + shown) + " of " + data.matched : "none";
  $("#prev").disabled = data.offset <= 0;
  $("#next").disabled = data.offset + shown >= data.matched;
}

let listRequest = 0, listAnswers = 0;

async function loadSessions() {
  // Quick changes (sort, then order) send requests that may answer out of order: only the
  // newest one's answer is drawn, so the list never shows a choice the user has left.
  const mine = ++listRequest;
  const data = await api("sessions?" + listQuery());
  $("#sessions").dataset.answers = ++listAnswers;  // the tests wait on this, drawn or not
  if (mine !== listRequest) return;
  state.listed = true;
  state.live = data.live;
  state.list.sortUsed = data.sort;
  $("#source").textContent = data.source + (data.live && REFRESH_S > 0 ? " · live: refreshed every " + REFRESH_S + " s" : "");
  renderListControls(data);
  // The column of the key sorted by, when it is metadata (trainer_step, task...), else step.
  const key = OWN.has(data.sort) && data.sort !== "version" ? (data.keys.some((k) => k.key === "trainer_step") ? "trainer_step" : "version") : data.sort;
  $("#key-head").textContent = key === "version" ? "weights" : key;
  const body = $("#sessions tbody");
  body.replaceChildren();
  // What the list shows, as the server sorted it (the tests wait on these).
  $("#sessions").dataset.sort = data.sort;
  $("#sessions").dataset.order = data.descending ? "desc" : "asc";
  $("#sessions").dataset.offset = data.offset;
  for (const s of data.sessions) {
    const meta = metaText(s.metadata);
    const name = el("td", { title: s.id + (meta ? "\n" + meta : "") }, el("a", { href: sessionHref(s.id) }, s.id),
      s.live ? el("span", { class: "badge live" }, "live") : null,
      s.rows > 1 ? el("span", { class: "muted" }, " " + s.rows + " rows" + (s.dead_rows ? " (" + s.dead_rows + " dead)" : "")) : null);
    const calls = s.state && s.state.metrics ? Math.max(s.calls, s.state.metrics.calls) : s.calls;
    const open = (e) => { if (!e.target.closest("a")) location.hash = sessionHref(s.id); };
    body.append(el("tr", { class: "session", "data-session": s.id, onclick: open },
      name, el("td", { class: "reward num" }, fmtReward(s.reward)), el("td", { class: "num" }, calls),
      el("td", { class: "num", title: s.tokens + " tokens, " + s.trained_tokens + " trained" }, fmtNum(s.tokens) + " / " + fmtNum(s.trained_tokens)),
      el("td", { class: "end" }, s.end_reason || (s.live ? "" : "open")), el("td", { class: "key" }, keyValue(s, key)),
      el("td", { class: "meta muted", title: meta }, meta)));
  }
  markSelected();
  if (!data.sessions.length) body.append(el("tr", {}, el("td", { colspan: 7, class: "muted" }, data.total ? "No session matches." : "No sessions yet.")));
}

function refreshList() { loadSessions().catch(showError); }

function addFilter(key, value) {
  state.list.filters = state.list.filters.filter(([k]) => k !== key).concat([[key, String(value)]]);
  state.list.offset = 0;
  refreshList();
}

function setupList() {
  $("#sort").addEventListener("change", () => { state.list.sort = $("#sort").value; state.list.offset = 0; refreshList(); });
  $("#order").addEventListener("change", () => { state.list.order = $("#order").value; state.list.offset = 0; refreshList(); });
  let timer = null;
  $("#search").addEventListener("input", () => {
    clearTimeout(timer);
    timer = setTimeout(() => { state.list.q = $("#search").value; state.list.offset = 0; refreshList(); }, 200);
  });
  $("#filter-key").addEventListener("change", () => {
    const key = $("#filter-key").value, values = $("#filter-value");
    if (!key) { values.hidden = true; return; }
    const found = state.list.keys.find((k) => k.key === key);
    const options = key === "status" ? ["live", "open", "stop", "max_calls", "max_tokens", "deadline", "limit", "error", "cancelled"] : (found ? found.values : []);
    values.replaceChildren(el("option", { value: "" }, "value…"), ...options.map((v) => el("option", { value: v }, v)));
    values.hidden = false;
  });
  $("#filter-value").addEventListener("change", () => {
    const key = $("#filter-key").value, value = $("#filter-value").value;
    if (key && value) { addFilter(key, value); $("#filter-key").value = ""; $("#filter-value").hidden = true; }
  });
  $("#prev").addEventListener("click", () => { state.list.offset = Math.max(0, state.list.offset - LIST_PAGE); refreshList(); });
  $("#next").addEventListener("click", () => { state.list.offset += LIST_PAGE; refreshList(); });
}

function show(view) {
  for (const name of ["run", "group", "session", "row"]) $("#" + name + "-view").hidden = view !== name;
  $("#nav-run").classList.toggle("on", view === "run");
}

// -- the run view --------------------------------------------------------------------------
// Another run drawn over this one: ?compare=OUT2 in the page's address (an output folder on
// the viewer's machine), its reward, tokens and time per step beside this run's.
const COMPARE = new URLSearchParams(location.search).get("compare") || "";
const COMPARE_COLOUR = "#ef6c00", COMPARE_COLOUR_NAME = "in orange";
// The time plot says whose time it is: the trainer's own step time where its adapter sent it
// (time_source "trainer"), else the span from a step's first call to its last.
function timeTitle(steps) {
  const told = steps.filter((s) => s.time_source === "trainer").length;
  const timed = steps.filter((s) => s.time_s !== null && s.time_s !== undefined).length;
  if (told && told === timed) return "time per step (the trainer's, s)";
  if (told) return "time per step (the trainer's where it sent it, else first call to last, s)";
  return "time per step (first call to last, s)";
}
function runQuery() {
  const query = [];
  if (state.runBy) query.push("by=" + encodeURIComponent(state.runBy));
  if (COMPARE) query.push("compare=" + encodeURIComponent(COMPARE));
  return "run" + (query.length ? "?" + query.join("&") : "");
}

async function loadRun() {
  const data = await api(runQuery());
  state.run = data;
  renderRun(data);
}

// Both runs' steps on one axis: this run's in its order, then the other's it lacks.
function unionLabels(own, other) {
  const seen = new Set(own);
  const extra = other.filter((l) => !seen.has(l));
  const numeric = own.concat(extra).every((l) => l !== "" && !Number.isNaN(Number(l)));
  const all = own.concat(extra);
  return numeric ? all.sort((a, b) => Number(a) - Number(b)) : all;
}

function renderRun(data) {
  const by = $("#run-by");
  const choices = ["trainer_step", "version"].concat(data.keys.filter((k) => k !== "trainer_step"));
  by.replaceChildren(...choices.map((k) => el("option", { value: k }, k === "version" ? "weight version" : k)));
  by.value = data.by;
  const cmp = data.compare || null;
  const labels = unionLabels(data.steps.map((s) => s.step), cmp ? cmp.steps.map((s) => s.step) : []);
  const own = new Map(data.steps.map((s) => [s.step, s])), other = new Map((cmp ? cmp.steps : []).map((s) => [s.step, s]));
  // This run's steps on the shared axis (a step only the other run has: an empty one).
  const EMPTY = { sessions: 0, rewarded: 0, reward: { mean: null, std: null, min: null, max: null }, statuses: {}, tokens: null, trained_tokens: null, calls: 0, time_s: null };
  const steps = labels.map((l) => own.get(l) || { ...EMPTY, step: l });
  const theirs = (f) => labels.map((l) => (other.has(l) ? f(other.get(l)) : null));
  const named = (s) => (cmp ? s + ", this run" : s);
  $("#run-summary").textContent = (cmp ? "Compared with " + cmp.source + " (" + cmp.sessions + " sessions, " + COMPARE_COLOUR_NAME + "). This run: " : "") +
    data.sessions + " sessions, " + data.steps.length + " " + (data.by === "version" ? "weight versions" : data.by + " values") +
    ", " + data.group_count + " groups" + (data.unstepped ? "; " + data.unstepped + (data.unstepped === 1 ? " session" : " sessions") + " without " + data.by : "") +
    (data.steps.length ? "" : ". No session carries " + data.by + ": set it in the session's metadata (trainer_step) or push weights with a version.");
  const xName = data.by === "version" ? "weight version" : data.by;
  const pick = (i) => addFilter(data.by, labels[i]);
  const r = steps.map((s) => s.reward);
  const plots = [
    plot({ name: "reward", title: "reward: mean ± spread (std), min–max", kind: "line", labels, xName, onclick: pick,
      series: [{ name: named("reward"), colour: "#1565c0", values: r.map((x) => x.mean), lo: r.map((x) => x.mean === null ? null : x.mean - x.std),
        hi: r.map((x) => x.mean === null ? null : x.mean + x.std), min: r.map((x) => x.min), max: r.map((x) => x.max) }]
        .concat(cmp ? [{ name: "reward, " + cmp.name, colour: COMPARE_COLOUR, values: theirs((s) => s.reward.mean) }] : []),
      extra: (i) => [steps[i].rewarded + " of " + steps[i].sessions + " sessions rewarded"] }),
    plot({ name: "status", title: "sessions per status", kind: "stack", labels, xName, onclick: pick,
      series: data.statuses.map((st, j) => ({ name: st, colour: statusColour(st, j), values: steps.map((s) => s.statuses[st] || 0) })) }),
    plot({ name: "tokens", title: "tokens per step", kind: "bars", labels, xName, onclick: pick,
      series: [{ name: "all", colour: "#90a4ae", values: steps.map((s) => s.tokens) }, { name: named("trained"), colour: "#2e7d32", values: steps.map((s) => s.trained_tokens) }]
        .concat(cmp ? [{ name: "trained, " + cmp.name, colour: COMPARE_COLOUR, values: theirs((s) => s.trained_tokens) }] : []),
      extra: (i) => [steps[i].calls + " calls"] }),
    plot({ name: "time", title: timeTitle(steps), kind: "bars", labels, xName, unit: " s", onclick: pick,
      series: [{ name: named("time"), colour: "#6d4c41", values: steps.map((s) => s.time_s) }]
        .concat(cmp ? [{ name: "time, " + cmp.name, colour: COMPARE_COLOUR, values: theirs((s) => s.time_s) }] : []) }),
  ];
  $("#plots").replaceChildren(...plots);
  $("#group-count").textContent = "(" + data.group_count + (data.groups.length < data.group_count ? ", newest " + data.groups.length + " shown" : "") + ")";
  const body = $("#groups tbody");
  body.replaceChildren();
  for (const g of data.groups) {
    const statuses = Object.entries(g.statuses).map(([k, v]) => k + " " + v).join(", ");
    body.append(el("tr", { class: "group", "data-group": g.id, onclick: (e) => { if (!e.target.closest("a")) location.hash = groupHref(g.id); } },
      el("td", {}, el("a", { href: groupHref(g.id) }, g.id)), el("td", {}, g.trainer_step ?? ""), el("td", { class: "num" }, g.n),
      el("td", { class: "num" }, fmtNum(g.reward.mean)), el("td", { class: "num" }, fmtNum(g.reward.std)),
      el("td", { class: "num" }, fmtNum(g.reward.min)), el("td", { class: "num" }, fmtNum(g.reward.max)), el("td", {}, statuses)));
  }
  if (!data.groups.length) body.append(el("tr", {}, el("td", { colspan: 8, class: "muted" }, "No session carries a group_id.")));
}

// -- a group: its rollouts side by side ---------------------------------------------------
// Where a group's advantages come from: the trainer's own (sent by its adapter), or this page's
// estimate (which is not what a trainer that scales by the group's spread used).
const ADVANTAGE_SAYS = {
  trainer: "advantage: the trainer's own",
  estimate: "advantage: an estimate, reward − group mean (the trainer sent none)",
  mixed: "advantage: the trainer's own where it sent one (†), else reward − group mean",
};
function renderGroup(g) {
  $("#group-id").textContent = g.id;
  $("#group-meta").textContent = (g.trainer_step !== null ? "trainer_step " + g.trainer_step + ", " : "") + g.rollouts.length + " rollouts, reward mean " +
    fmtNum(g.reward.mean) + " ± " + fmtNum(g.reward.std) + "; " + ADVANTAGE_SAYS[g.advantage_source];
  $("#advantage-head").textContent = g.advantage_source === "trainer" ? "advantage (trainer)" : g.advantage_source === "mixed" ? "advantage" : "advantage (estimate)";
  const labels = g.rollouts.map((r) => String(r.index ?? r.id));
  $("#group-plot").replaceChildren(plot({ name: "group", title: "reward per rollout (advantage on hover)", kind: "bars", labels, xName: "rollout",
    series: [{ name: "reward", colour: "#1565c0", values: g.rollouts.map((r) => r.reward) }],
    hline: { value: g.reward.mean, label: "mean " + fmtNum(g.reward.mean) },
    extra: (i) => ["advantage " + fmtSigned(g.rollouts[i].advantage), g.rollouts[i].status],
    onclick: (i) => { location.hash = sessionHref(g.rollouts[i].id); } }));
  const body = $("#group-rollouts tbody");
  body.replaceChildren();
  for (const r of g.rollouts) {
    const rows = el("td", {});
    r.rows.forEach((row, k) => {
      if (k) rows.append(" ");
      rows.append(el("a", { href: rowHref(r.id, row.thread_id), class: "row-link", title: row.thread_id + (row.parent_relation ? " (" + row.parent_relation + ")" : "") },
        row.thread_id.length > 14 ? row.thread_id.slice(0, 13) + "…" : row.thread_id));
      if (row.dead) rows.append(el("span", { class: "badge dead" }, "dead"));
    });
    const adv = r.advantage;
    body.append(el("tr", { class: "rollout", "data-session": r.id, onclick: (e) => { if (!e.target.closest("a")) location.hash = sessionHref(r.id); } },
      el("td", {}, r.index ?? ""), el("td", {}, el("a", { href: sessionHref(r.id) }, r.id)),
      el("td", { class: "num reward" }, fmtReward(r.reward)),
      el("td", { class: "num advantage " + (adv > 0 ? "pos" : adv < 0 ? "neg" : ""), "data-source": r.advantage_source },
        fmtSigned(adv) + (g.advantage_source === "mixed" && r.advantage_source === "trainer" ? " †" : "")),
      el("td", {}, r.status), el("td", { class: "num" }, r.calls), el("td", { class: "num" }, r.trained_tokens),
      el("td", {}, r.end_reason || ""), el("td", {}, r.versions.join(", ")), rows));
  }
}

// -- routing ------------------------------------------------------------------------------
async function route() {
  const nav = ++state.nav;
  const fresh = takeToken();
  const params = hashParams();
  const sid = params.get("session") || null, tid = params.get("row") || null, gid = params.get("group") || null;
  if (fresh || !state.listed || (sid === null && gid === null)) await loadSessions();
  if (nav !== state.nav) return;
  if (sid === null && gid !== null) {
    const g = await api("groups/" + encodeURIComponent(gid));
    if (nav !== state.nav) return;
    state.session = null;
    state.gen += 1;
    markSelected();
    renderGroup(g);
    show("group");
    $("#right").scrollTop = 0;
    return;
  }
  if (sid === null) {
    state.session = null;
    state.data = null;
    state.gen += 1;
    markSelected();
    await loadRun();
    if (nav !== state.nav) return;
    show("run");
    return;
  }
  // A session's page reads it afresh (a live one moves on); a row of the session shown reuses it.
  if (tid === null || state.session !== sid || !state.data) {
    const data = await api("sessions/" + encodeURIComponent(sid));
    if (nav !== state.nav) return;
    renderSession(sid, data);
  }
  if (tid === null) {
    state.gen += 1;
    show("session");
    $("#right").scrollTop = 0;
    return;
  }
  const node = findNode(state.data.tree, tid);
  if (!node) {
    show("session");
    throw new Error("session " + sid + " has no row " + tid);
  }
  await openRow(node);
}

function findNode(nodes, tid) {
  for (const n of nodes) {
    if (n.thread_id === tid) return n;
    const hit = findNode(n.children, tid);
    if (hit) return hit;
  }
  return null;
}

function renderSession(sid, data) {
  state.session = sid;
  state.data = data;
  state.calls = data.calls;
  markSelected();
  $("#diff-view").hidden = true;
  $("#session-id").textContent = sid;
  const s = data.session;
  const gid = s.metadata && typeof s.metadata === "object" ? s.metadata.group_id : null;
  const groupLink = $("#session-group");
  groupLink.hidden = gid === null || gid === undefined;
  if (!groupLink.hidden) { groupLink.setAttribute("href", groupHref(String(gid))); groupLink.textContent = "group " + gid + " →"; }
  const live = s.state ? "live: " + s.state.metrics.calls + " calls, " + s.state.metrics.prompt_tokens + " prompt + " +
    s.state.metrics.completion_tokens + " sampled tokens, " + s.state.in_flight + " in flight, backend " + (s.state.backend || "?") : "";
  $("#session-meta").replaceChildren(
    el("div", {}, "reward: " + (fmtReward(s.reward) || "none") + "   end: " + (s.end_reason || "open") +
      (s.versions && s.versions.length ? "   weights: " + s.versions.join(", ") : "")),
    s.metadata ? el("div", {}, "metadata: " + metaText(s.metadata)) : "",
    live ? el("div", {}, live) : "");
  $("#tree").replaceChildren(treeList(sid, data.tree));
  const body = $("#calls tbody");
  body.replaceChildren();
  for (const c of data.calls) {
    const tools = c.tool_calls.map((t) => t.name + "(" + t.arguments + ")").join("; ");
    body.append(el("tr", { "data-request": c.request_id },
      el("td", {}, el("input", { type: "radio", name: "diff-a", value: c.request_id, onchange: diffReady })),
      el("td", {}, el("input", { type: "radio", name: "diff-b", value: c.request_id, onchange: diffReady })),
      el("td", {}, c.turn_index), el("td", {}, el("code", {}, c.request_id)),
      el("td", {}, c.prompt_tokens), el("td", {}, c.completion_tokens),
      el("td", {}, c.finish_reason || ""), el("td", {}, c.response_finish_reason || ""),
      el("td", {}, c.backend || ""), el("td", {}, c.latency_s != null ? c.latency_s.toFixed(3) + " s" : ""),
      el("td", { class: "tool-calls" }, tools)));
  }
  diffReady();
}

function treeList(sid, nodes) {
  const ul = el("ul", { class: "tree" });
  for (const n of nodes) {
    const label = el("a", { class: "node", href: rowHref(sid, n.thread_id), "data-thread": n.thread_id },
      el("code", {}, n.thread_id),
      n.parent_relation ? el("span", { class: "badge rel" }, n.parent_relation) : null,
      n.dead ? el("span", { class: "badge dead" }, "dead" + (n.dead_reason ? ": " + n.dead_reason : "")) : null,
      n.pending ? el("span", { class: "badge pending" }, "not written yet") : null,
      ...(n.versions || []).map((v) => el("span", { class: "badge version", title: "weights that sampled it" }, v)),
      " " + n.tokens + " tokens, " + n.trained_tokens + " trained, " + n.num_turns + " call(s) trained",
      n.reward != null ? ", reward " + fmtReward(n.reward) : "",
      n.parent_tool_call_id ? ", spawned by " + n.parent_tool_call_id : "");
    ul.append(el("li", {}, label, n.children.length ? treeList(sid, n.children) : null));
  }
  return ul;
}

// The weight version that gave position pos its logprob (the row's spans), or "".
function versionAt(node, pos) {
  for (const s of node.weight_versions || []) if (s.start <= pos && pos < s.end) return s.version;
  return "";
}

function callVersions(t) { return t.versions && t.versions.length ? " · weights " + t.versions.join(", ") : ""; }

// A row opens at its first trained token (loss mask 1), not at token 0: a row's sampled tokens
// may sit 12k prompt tokens in.
async function openRow(node) {
  state.row = node;
  state.gen += 1;
  const gen = state.gen;
  show("row");
  $("#back-to-session").setAttribute("href", sessionHref(state.session));
  $("#back-session-id").textContent = state.session;
  $("#row-id").textContent = node.thread_id;
  $("#row-meta").textContent = node.tokens + " tokens, " + node.trained_tokens + " trained" +
    (node.first_trained != null ? " from token " + node.first_trained : "") +
    (node.dead ? ", dead (" + (node.dead_reason || "") + ")" : "") + (node.parent_relation ? ", " + node.parent_relation + " of " + node.parent_thread_id : "") +
    (node.versions && node.versions.length ? "; sampled by weights " + node.versions.join(", ") : "");
  $("#overview").textContent = "";
  $("#strip-box").replaceChildren();
  const calls = el("ol", { start: 0 });
  for (const t of node.turns) {
    calls.append(el("li", {},
      el("a", { href: "#", onclick: (e) => { e.preventDefault(); jumpTo(t.start); } }, t.request_id),
      " tokens " + t.start + ".." + t.end + ", " + (t.finish_reason || "") + ", " + t.status +
      (t.trained_in && t.status !== "trained" ? " (trained in " + t.trained_in + ")" : "") +
      (t.backend ? ", " + t.backend : "") + (t.latency_s != null ? ", " + t.latency_s.toFixed(3) + " s" : "") + callVersions(t)));
  }
  $("#row-calls").replaceChildren(calls);
  const box = $("#tokens");
  box.replaceChildren();
  state.pages = new Map();
  if (state.observer) state.observer.disconnect();
  const count = Math.max(1, Math.ceil(node.tokens / PAGE));
  const divs = [];
  for (let i = 0; i < count; i++) {
    const div = el("div", { class: "page unloaded", "data-page": i }, "tokens " + i * PAGE + "…");
    box.append(div);
    divs.push(div);
  }
  $("#right").scrollTop = 0;
  const first = node.first_trained;
  if (first != null && first > 0 && first < node.tokens) await jumpTo(first, true);
  else await loadPage(0, true);
  if (gen !== state.gen) return;
  // Pages load as they scroll in, from where the row opened.
  state.observer = new IntersectionObserver((entries) => {
    for (const e of entries) if (e.isIntersecting) loadPage(Number(e.target.dataset.page));
  }, { root: $("#right"), rootMargin: "600px" });
  for (const div of divs) state.observer.observe(div);
}

function heat(lp) {
  // exp(logprob) is the sampled token's probability: 1 shows no colour, 0 full red.
  const p = Math.exp(lp);
  const a = Math.min(0.85, Math.max(0, 1 - p) * 0.85);
  return "rgba(229, 57, 53, " + a.toFixed(3) + ")";
}

async function loadPage(i, overview) {
  if (state.pages.has(i)) return state.pages.get(i);
  const node = state.row, gen = state.gen;
  const promise = (async () => {
    const page = await api("sessions/" + encodeURIComponent(state.session) + "/rows/" +
      encodeURIComponent(node.thread_id) + "?offset=" + i * PAGE + "&limit=" + PAGE + (overview ? "&overview=1" : ""));
    if (gen !== state.gen) return;
    const div = document.querySelector('#tokens .page[data-page="' + i + '"]');
    if (!div) return;
    const starts = new Map(), ends = new Map();
    node.turns.forEach((t, k) => { if (t.start >= 0) { starts.set(t.start, [k, t]); ends.set(t.end, [k, t]); } });
    const frag = document.createDocumentFragment();
    for (let j = 0; j < page.ids.length; j++) {
      const pos = page.offset + j;
      if (ends.has(pos) && pos > 0) { const [k, t] = ends.get(pos); frag.append(el("span", { class: "call-mark end", "data-end": k }, "■ call " + k + ": " + (t.finish_reason || ""))); }
      if (starts.has(pos)) { const [k, t] = starts.get(pos); frag.append(el("span", { class: "call-mark", id: "call-" + k, "data-start": k }, "▶ call " + k + " " + t.request_id + callVersions(t))); }
      const prov = page.provenance[j], mask = page.loss_mask[j], lp = page.logprobs[j];
      const span = document.createElement("span");
      span.className = "t p" + prov + (mask ? " m1" : "");
      span.dataset.i = pos;
      span.textContent = page.text[j];
      if (prov === 1 || prov === 2) span.style.background = heat(lp);
      span.title = "#" + pos + "  id " + page.ids[j] + "  " + PROV[prov] + (mask ? ", trained" : ", not trained") +
        (prov === 1 || prov === 2 ? "  logprob " + lp : "") + (versionAt(node, pos) ? "  weights " + versionAt(node, pos) : "");
      frag.append(span);
    }
    const last = page.offset + page.ids.length;
    if (last === page.total && ends.has(last)) { const [k, t] = ends.get(last); frag.append(el("span", { class: "call-mark end", "data-end": k }, "■ call " + k + ": " + (t.finish_reason || ""))); }
    // A page that starts above the view grows as it is drawn: what follows it stays in place.
    const root = $("#right");
    const rect = div.getBoundingClientRect();
    const above = rect.top < root.getBoundingClientRect().top;
    div.replaceChildren(frag);
    div.classList.remove("unloaded");
    if (above) root.scrollTop += div.getBoundingClientRect().bottom - rect.bottom;
    if (page.overview) {
      const o = page.overview;
      $("#overview").textContent = PROV.map((p) => p + " " + o.provenance[p]).join(", ") +
        "; loss mask 1 on " + o.trained + " of " + o.total;
      $("#strip-box").replaceChildren(strip(o.strip, node.weight_versions, node.turns, (pos) => jumpTo(pos)));
    }
  })();
  state.pages.set(i, promise);
  try { await promise; } catch (err) { state.pages.delete(i); showError(err); }
}

async function jumpTo(pos, overview) {
  if (pos < 0) return;
  await loadPage(Math.floor(pos / PAGE), overview);
  const span = document.querySelector('#tokens .t[data-i="' + pos + '"]');
  if (span) span.scrollIntoView({ block: "center" });
}

function diffReady() {
  const a = document.querySelector('input[name="diff-a"]:checked');
  const b = document.querySelector('input[name="diff-b"]:checked');
  $("#diff-button").disabled = !(a && b && a.value !== b.value);
}

async function showDiff() {
  const a = document.querySelector('input[name="diff-a"]:checked').value;
  const b = document.querySelector('input[name="diff-b"]:checked').value;
  const d = await api("sessions/" + encodeURIComponent(state.session) + "/diff?a=" + encodeURIComponent(a) + "&b=" + encodeURIComponent(b));
  $("#diff-view").hidden = false;
  $("#diff-title").textContent = d.a + " → " + d.b;
  const changed = d.ops.filter((o) => o.op !== "equal");
  $("#diff-summary").textContent = d.extends
    ? "The later prompt extends the earlier call exactly (" + d.a_tokens + " tokens kept, " + (d.b_tokens - d.a_tokens) + " added): nothing was rewritten."
    : "The later prompt kept " + d.kept + " of the earlier call's " + d.a_tokens + " tokens; " + changed.length + " change(s).";
  const box = $("#diff");
  box.replaceChildren();
  for (const o of d.ops) {
    if (o.op === "equal") {
      box.append(el("span", { class: "d-equal" }, o.a.text));
      if (o.a.elided) box.append(el("span", { class: "elided" }, " … " + o.a.elided + " tokens unchanged … "), el("span", { class: "d-equal" }, o.a.tail));
      continue;
    }
    if (o.a) box.append(el("span", { class: "d-delete", title: "dropped: " + o.a.tokens + " tokens" }, o.a.text));
    if (o.b) box.append(el("span", { class: "d-insert", title: "added: " + o.b.tokens + " tokens" }, o.b.text));
  }
}

// -- a live run moves on ------------------------------------------------------------------
// On a running proxy the list, the run view and a group's view are read again every REFRESH_S
// seconds while the tab is visible, without a reload and without leaving where the user is
// (?refresh_s=N in the page's address; 0: never). A session's own page is read on opening.
const REFRESH_S = (() => {
  const given = new URLSearchParams(location.search).get("refresh_s");
  const value = given === null ? 5 : Number(given);
  return Number.isFinite(value) && value >= 0 ? value : 5;
})();
let refreshing = false;
async function refreshLive() {
  if (!state.live || refreshing || document.hidden) return;
  const params = hashParams();
  if (params.get("session")) return;
  refreshing = true;
  const nav = state.nav;
  try {
    await loadSessions();
    const gid = params.get("group") || null;
    const data = await api(gid !== null ? "groups/" + encodeURIComponent(gid) : runQuery());
    if (nav !== state.nav) return;  // the user went elsewhere meanwhile: that page stands
    if (gid !== null) renderGroup(data);
    else { state.run = data; renderRun(data); }
    document.body.dataset.refreshes = String(Number(document.body.dataset.refreshes || 0) + 1);
  } catch (err) {
    showError(err);
  } finally {
    refreshing = false;
  }
}
if (REFRESH_S > 0) setInterval(refreshLive, REFRESH_S * 1000);

$("#diff-button").addEventListener("click", () => showDiff().catch(showError));
$("#run-by").addEventListener("change", () => { state.runBy = $("#run-by").value; loadRun().catch(showError); });
setupList();
function go() {
  showError(null);
  route().catch(showError);
}
window.addEventListener("hashchange", go);
go();
