// The dashboard's pages, drawn from /api/<page> and redrawn when /api/stamp changes (polled
// once a second): a running search's new trials and metrics appear without a reload.
"use strict";

const APP = document.getElementById("app");
const PAGE = APP ? APP.dataset.page : null;
const QUERY = new URLSearchParams(location.search);
const EXP = QUERY.get("exp");
const tableState = {};   // table id -> {sort: column index, dir: 1|-1, filter: text}
const LAYOUT = {margin: {l: 60, r: 20, t: 36, b: 48}, paper_bgcolor: "#fff",
                plot_bgcolor: "#fff", colorway: ["#1565c0", "#e65100", "#2e7d32", "#6a1b9a",
                "#00838f", "#c62828", "#9e9d24", "#4e342e"],
                font: {family: "system-ui, sans-serif", size: 12}, height: 320};
const AXIS = {gridcolor: "#eceff1", zeroline: false, automargin: true};

function titled(layout) {  // plotly.js takes titles as {text}
  const out = {...LAYOUT, ...layout};
  if (typeof out.title === "string") out.title = {text: out.title, font: {size: 13}};
  for (const ax of ["xaxis", "yaxis"]) {
    out[ax] = {...AXIS, ...(out[ax] || {})};
    if (typeof out[ax].title === "string") out[ax].title = {text: out[ax].title};
  }
  return out;
}
const CONFIG = {displaylogo: false, responsive: true};

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "text") node.textContent = v; else if (k === "html") node.innerHTML = v;
    else node.setAttribute(k, v);
  }
  for (const c of children) if (c != null) node.append(c);
  return node;
}

function withExp(path, extra) {
  const q = new URLSearchParams(extra || {});
  if (EXP && !q.has("exp")) q.set("exp", EXP);
  const s = q.toString();
  return s ? `${path}?${s}` : path;
}

async function getJSON(url) {
  const res = await fetch(url, {cache: "no-store"});
  const data = await res.json();
  if (!res.ok) throw Object.assign(new Error(data.error || res.statusText), {title: data.title});
  return data;
}

// ---- building blocks: cards, key-values, tables, charts ----------------------------------

function card(id, title, wide) {
  let node = document.getElementById(id);
  if (!node) {
    node = el("section", {id, class: "card" + (wide ? " wide" : "")}, el("h2", {text: title}),
              el("div", {class: "body"}));
    APP.append(node);
  }
  return node.querySelector(".body");
}

function fmt(v) {
  if (v === null || v === undefined) return "–";
  if (typeof v === "number") {
    if (Number.isInteger(v)) return v > 1e9 ? new Date(v * 1000).toLocaleString() : String(v);
    if (v > 1e9) return new Date(v * 1000).toLocaleString();  // a Unix time
    return Math.abs(v) >= 1000 ? v.toFixed(1) : v.toPrecision(4);
  }
  if (typeof v === "object") return JSON.stringify(v);
  return String(v);
}

function keyValues(body, pairs) {
  body.replaceChildren(el("dl", {class: "kv"}, ...pairs.flatMap(([k, v, id]) => [
    el("dt", {text: k}), el("dd", id ? {id} : {}, v instanceof Node ? v : fmt(v))])));
}

const LINKS = {  // a column's cells link to the page of what they name
  trial: v => withExp("/trial", {id: v}), parent_trial: v => withExp("/trial", {id: v}),
  model: v => withExp("/model", {id: v}), parent_model: v => withExp("/model", {id: v}),
  model_id: v => withExp("/model", {id: v}),
};

function compare(a, b) {
  if (a === b) return 0;
  if (a === null || a === undefined) return 1;   // empty cells last, either way
  if (b === null || b === undefined) return -1;
  if (typeof a === "number" && typeof b === "number") return a - b;
  return String(a).localeCompare(String(b), undefined, {numeric: true});
}

// A sortable, filterable table with its CSV download; redrawn in place, keeping its state.
function dataTable(body, id, page, name, data, linkCols) {
  const st = tableState[id] || (tableState[id] = {sort: null, dir: 1, filter: ""});
  let wrap = body.querySelector(`[data-table="${id}"]`);
  if (!wrap) {
    const filter = el("input", {type: "search", placeholder: "filter rows…", class: "filter",
                                id: `${id}-filter`});
    filter.addEventListener("input", () => { st.filter = filter.value; draw(); });
    const csv = el("a", {class: "csv", href: withExp(`/api/${page}.csv`,
                        Object.fromEntries([...QUERY, ["table", name]])), download: ""},
                   "CSV");
    wrap = el("div", {"data-table": id, class: "table-wrap"},
              el("div", {class: "tools"}, filter, el("span", {class: "count"}), csv),
              el("div", {class: "scroll"}, el("table", {id})));
    body.append(wrap);
  }
  wrap.data = data;
  function draw() {
    const d = wrap.data, table = wrap.querySelector("table");
    const needle = st.filter.trim().toLowerCase();
    let rows = d.rows.filter(r => !needle || r.some(c => fmt(c).toLowerCase().includes(needle)
                                                     || String(c).toLowerCase().includes(needle)));
    if (st.sort !== null) rows = [...rows].sort((a, b) => st.dir * compare(a[st.sort], b[st.sort]));
    const head = el("tr", {}, ...d.columns.map((c, i) => {
      const th = el("th", {text: c + (st.sort === i ? (st.dir > 0 ? " ▲" : " ▼") : ""),
                           "data-col": c, title: "sort"});
      th.addEventListener("click", () => {
        st.dir = st.sort === i ? -st.dir : 1; st.sort = i; draw();
      });
      return th;
    }));
    const links = linkCols || LINKS;
    const tbody = el("tbody", {}, ...rows.map(r => el("tr", {}, ...r.map((c, i) => {
      const link = links[d.columns[i]];
      const text = fmt(c);
      return el("td", {title: typeof c === "string" && c.length > 60 ? c : ""},
                link && c !== null && c !== undefined ? el("a", {href: link(c)}, text) : text);
    }))));
    table.replaceChildren(el("thead", {}, head), tbody);
    wrap.querySelector(".count").textContent =
      rows.length === d.rows.length ? `${d.rows.length} rows` : `${rows.length} of ${d.rows.length} rows`;
  }
  draw();
}

function chart(body, id, traces, layout) {
  let div = document.getElementById(id);
  if (!div) { div = el("div", {id, class: "chart"}); body.append(div); }
  if (window.Plotly) Plotly.react(div, traces, titled(layout), CONFIG);
  return div;
}

function note(body, id, text) {
  let p = document.getElementById(id);
  if (!p) { p = el("p", {id, class: "note"}); body.append(p); }
  p.textContent = text || "";
  p.hidden = !text;
}

function pre(body, id, text) {
  let p = document.getElementById(id);
  if (!p) { p = el("pre", {id, class: "code"}); body.append(p); }
  if (p.textContent !== text) p.textContent = text;
}

// ---- pages ---------------------------------------------------------------------------------

const RENDER = {
  experiments(d) {
    const t = d.tables.experiments;
    dataTable(card("c-exps", "Experiments in this store", true), "experiments", "experiments",
              "experiments", t, {id: v => `/overview?exp=${v}`});
    const body = card("c-compare", "Compare two experiments");
    if (!body.querySelector("form")) {
      const ids = t.rows.map(r => r[0]);
      const pick = (name, i) => el("select", {name}, ...ids.map(v => {
        const o = el("option", {value: v, text: `experiment ${v}`});
        if (v === ids[Math.max(0, ids.length - 1 - i)]) o.selected = true;
        return o;
      }));
      body.append(el("form", {action: "/compare", method: "get", class: "inline"},
                     pick("a", 1), pick("b", 0), el("button", {type: "submit", text: "compare"})));
    }
  },

  overview(d) {
    const b = d.budget, best = d.best, o = d.objectives;
    const bestLink = best ? el("a", {href: withExp("/model", {id: best.model_id})},
                               `model ${best.model_id}: ${fmt(best.value)}`) : "no result yet";
    const several = o.metrics.length > 1;
    const front = several ? el("a", {href: withExp("/pareto")},
      d.front && d.front.length ? `${d.front.length} models on the Pareto front`
                                : "no model on the front yet") : null;
    keyValues(card("c-summary", `Experiment ${d.experiment}: ${d.name}`), [
      ["status", d.status, "kv-status"],
      ["optimizes", o.metrics.map((m, i) => `${m} (${o.modes[i]})`).join(", "), "kv-optimizes"],
      ...(o.constraints.length ? [["subject to", o.constraints.join(", "), "kv-constraints"]] : []),
      several ? ["result", front, "kv-front"] : ["best model", bestLink, "kv-best"],
      ...(several ? [[`best ${d.metric}`, bestLink, "kv-best"]] : []),
      ["budget used", b.max_models ? `${b.models_done} of ${b.max_models} models`
                                   : `${b.models_done} models finished`, "kv-budget"],
      ["models", b.models], ["seed", d.seed], ["started", d.created], ["updated", d.updated],
      ...(d.error ? [["error", d.error.split("\n")[0]]] : [])]);
    const st = d.trials_by_state;
    chart(card("c-states", "Trials by state"), "chart-states", [{type: "bar",
          x: Object.keys(st), y: Object.values(st),
          marker: {color: ["#90a4ae", "#42a5f5", "#ffb74d", "#66bb6a", "#ef5350"]}}],
          {height: 260});
    const s = d.best_so_far;
    chart(card("c-best", "Best so far, over models"), "chart-best-models", [{x: s.models, y: s.best, mode: "lines+markers",
          line: {shape: "hv"}, name: "best", text: s.model_ids.map(m => `model ${m}`)}],
          {xaxis: {title: "models finished", dtick: s.models.length < 12 ? 1 : undefined},
           yaxis: {title: d.metric}});
    chart(card("c-best-time", "Best so far, over time"), "chart-best-time", [{x: s.seconds, y: s.best, mode: "lines+markers",
          line: {shape: "hv"}, name: "best"}],
          {xaxis: {title: "seconds since the search started"}, yaxis: {title: d.metric}});
    const errs = card("c-errors", "Failed models and why", true);
    dataTable(errs, "errors", "overview", "errors", d.tables.errors);
    pre(card("c-config", "Configuration", true), "config", JSON.stringify(d.config, null, 2));
  },

  trials(d) {
    const curves = card("c-curves", `Learning curves (${d.metric})`, true);
    chart(curves, "chart-curves", Object.entries(d.curves).map(([t, pts]) => ({
      x: pts.map(p => p[0]), y: pts.map(p => p[1]), name: t, mode: "lines+markers",
      hovertemplate: `${t}<br>epoch %{x}: %{y}<extra></extra>`})),
      {xaxis: {title: "epoch", dtick: 1}, yaxis: {title: d.metric}, showlegend: false});
    dataTable(card("c-trials", "Trials", true), "trials", "trials", "trials", d.tables.trials);
  },

  trial(d) {
    keyValues(card("c-trial", `Trial ${d.trial}`), [
      ["state", d.state, "kv-state"], ["model", el("a", {href: withExp("/model", {id: d.model_id})},
                                                    `model ${d.model_id}`)],
      ["epochs", d.step], ["worker", d.worker],
      ["parent", d.parent ? el("a", {href: withExp("/trial", {id: d.parent})}, d.parent) : null],
      ["initiator", d.initiator], ["checkpoint", d.checkpoint, "kv-checkpoint"],
      ["attempts", d.attempts]]);
    dataTable(card("c-choices", "Choices"), "choices", "trial", "choices", d.tables.choices);
    const charts = card("c-trial-curves", "Learning curves", true);
    chart(charts, "chart-trial", Object.entries(d.curves).filter(([n]) => n !== "time_total_s")
      .map(([name, pts]) => ({x: pts.map(p => p[0]), y: pts.map(p => p[1]), name,
                              mode: "lines+markers"})),
      {xaxis: {title: "epoch", dtick: 1}, yaxis: {title: "value"}});
    if (d.error) pre(card("c-error", "Last error", true), "trial-error", d.error);
    dataTable(card("c-events", "Events", true), "events", "trial", "events", d.tables.events);
    dataTable(card("c-ckpts", "Checkpoints", true), "checkpoints", "trial", "checkpoints",
              d.tables.checkpoints);
    dataTable(card("c-metrics", "Every metric", true), "metrics", "trial", "metrics",
              d.tables.metrics);
  },

  space(d) {
    const pc = card("c-parcoords", `Choices vs ${d.metric}`, true);
    const dims = d.dimensions.map(x => x.numeric ? {label: x.label, values: x.values}
      : {label: x.label, values: x.values, tickvals: x.keys.map((_, i) => i), ticktext: x.keys,
         range: [-0.25, Math.max(x.keys.length - 1, 0) + 0.25]});
    chart(pc, "chart-parcoords", [{type: "parcoords", line: {color: d.values,
          colorscale: "Viridis", showscale: true, reversescale: d.mode === "min"},
          dimensions: [...dims, {label: d.metric, values: d.values}]}], {height: 420});
    const imp = card("c-importance", "Importance of each choice");
    note(imp, "importance-note", d.importance_note);
    const rows = d.tables.importance.rows;
    chart(imp, "chart-importance", [{type: "bar", orientation: "h", x: rows.map(r => r[1]),
          y: rows.map(r => r[0]), error_x: {type: "data", array: rows.map(r => r[2])}}],
          {xaxis: {title: "drop in R² when shuffled"}, height: 60 + 40 * Math.max(rows.length, 2),
           yaxis: {automargin: true}});
    dataTable(imp, "importance", "space", "importance", d.tables.importance);
    const lin = card("c-lineage", "Lineage", true);
    note(lin, "lineage-note", d.lineage_note);
    let svg = document.getElementById("lineage-svg");
    if (!svg) { svg = el("div", {id: "lineage-svg", class: "svg"}); lin.append(svg); }
    svg.innerHTML = d.lineage_svg || "";
    dataTable(lin, "lineage", "space", "lineage", d.tables.lineage);
    dataTable(card("c-models", "Models", true), "models", "space", "models", d.tables.models,
              {model: LINKS.model, parent: LINKS.model});
  },

  model(d) {
    const dl = el("span", {}, el("a", {href: withExp("/download/model.py", {id: d.model}),
                                       id: "download-py"}, "model.py"),
                  d.has_weights ? " · " : "",
                  d.has_weights ? el("a", {href: withExp("/download/model.pt", {id: d.model}),
                                           id: "download-pt"}, "weights (.pt)") : "");
    keyValues(card("c-model", `Model ${d.model}`), [
      ["status", d.status], ["value", d.value, "kv-value"],
      ["parameters", d.params, "kv-params"],
      ["FLOPs (one example)", d.flops !== null ? d.flops : d.flops_note, "kv-flops"],
      ...Object.entries(d.costs).map(([k, v]) => [k, v]),
      ["parent", d.parent ? el("a", {href: withExp("/model", {id: d.parent})}, `model ${d.parent}`)
                          : null],
      ["compared with", d.reference_is_base ? el("span", {}, "the base model",
          d.parent ? el("span", {}, " (", el("a", {href: withExp("/model", {id: d.model, vs: d.parent})},
                                             "compare with the parent"), ")") : "")
        : d.reference ? el("span", {}, el("a", {href: withExp("/model", {id: d.reference})},
                                            `model ${d.reference}`), " (",
                           el("a", {href: withExp("/model", {id: d.model})}, "with the base"), ")")
        : null, "kv-reference"],
      ["nodes changed", d.changed, "kv-changed"],
      ["nodes removed", d.removed.join(", ") || null], ["hash", d.hash], ["download", dl]]);
    dataTable(card("c-sample", "Choices"), "sample", "model", "choices", d.tables.choices);
    const arch = card("c-arch", "Architecture (changed nodes outlined in orange)", true);
    note(arch, "svg-note", d.svg_note);
    let svg = document.getElementById("arch-svg");
    if (!svg) { svg = el("div", {id: "arch-svg", class: "svg"}); arch.append(svg); }
    if (svg.dataset.hash !== d.hash) { svg.innerHTML = d.svg || ""; svg.dataset.hash = d.hash; }
    dataTable(card("c-nodes", "Nodes", true), "nodes", "model", "nodes", d.tables.nodes);
    const src = card("c-source", "Exported source", true);
    note(src, "source-note", d.source_note);
    pre(src, "source", d.source || "");
  },

  engine(d) {
    const s = card("c-jobs-status", "Grouped jobs by status");
    chart(s, "chart-jobs", [{type: "bar", x: Object.keys(d.jobs_by_status),
          y: Object.values(d.jobs_by_status)}], {height: 260});
    note(s, "jobs-note", Object.keys(d.jobs_by_status).length ? "" :
         d.tables.segments.rows.length ? "a one-shot search: each segment trains one " +
         "super-network (below), no grouped job" :
         "no grouped job: this search trained every model alone (optimize off, or a trainer " +
         "that shares no data pipeline)");
    chart(card("c-speedups", "Measured speed-up per job"), "chart-speedups", [{type: "bar",
          x: d.speedups.map(r => `#${r[0]}`), y: d.speedups.map(r => r[2]),
          text: d.speedups.map(r => r[3]), marker: {color: d.speedups.map(
            r => r[2] >= 1 ? "#66bb6a" : "#ef5350")}}],
          {height: 260, yaxis: {title: "time apart / time grouped"},
           xaxis: {type: "category", title: "grouped job (plans row)"},
           shapes: [{type: "line", xref: "paper", x0: 0, x1: 1, y0: 1, y1: 1,
                     line: {dash: "dot", color: "#555"}}]});
    dataTable(card("c-plans", "Grouped jobs: what each shared, layout and decision", true),
              "jobs", "engine", "jobs", d.tables.jobs);
    if (d.tables.segments.rows.length) {
      const seg = card("c-segments", "One-shot segments: the super-network, segment by segment", true);
      chart(seg, "chart-segments", Object.entries(d.segments).map(([name, pts]) => ({
            x: pts.map(p => p[0]), y: pts.map(p => p[1]), name, mode: "lines+markers"})),
            {xaxis: {title: "segment", dtick: 1}, yaxis: {title: "the strategy's metrics"}});
      dataTable(seg, "segments", "engine", "segments", d.tables.segments);
    }
    const sch = card("c-sched", "Scheduler decisions", true);
    note(sch, "reclaimed", `stopping trials early reclaimed ${d.reclaimed_epochs} epochs`);
    dataTable(sch, "scheduler", "engine", "scheduler", d.tables.scheduler);
  },

  pareto(d) {
    const body = card("c-pareto", "Pareto front", true);
    note(body, "pareto-note", d.note);
    if (d.note) return;
    const [a, b] = d.objectives;
    const side = on => d.points.filter(p => p.front === on);
    const trace = (pts, name, color) => ({x: pts.map(p => p.values[0]), y: pts.map(p => p.values[1]),
      text: pts.map(p => `model ${p.model}`), mode: "markers", name,
      marker: {size: 10, color}});
    chart(body, "chart-pareto", [trace(side(false), "dominated", "#b0bec5"),
          trace(side(true), "on the front", "#e65100")],
          {xaxis: {title: `${a} (${d.modes[0]})`}, yaxis: {title: `${b} (${d.modes[1]})`}});
    dataTable(body, "pareto", "pareto", "models", d.tables.models);
  },

  compare(d) {
    const body = card("c-compare", "Best so far of two experiments", true);
    chart(body, "chart-compare", d.series.map(s => ({x: s.models, y: s.best, name:
          `experiment ${s.experiment} (${s.metric})`, mode: "lines+markers", line: {shape: "hv"}})),
          {xaxis: {title: "models finished"}, yaxis: {title: "best value"}});
    dataTable(body, "compare", "compare", "best_so_far", d.tables.best_so_far);
  },
};

// ---- loading and polling -------------------------------------------------------------------

let lastStamp = null;

async function refresh() {
  try {
    const data = await getJSON(withExp(`/api/${PAGE}`, Object.fromEntries(QUERY)));
    const loading = APP.querySelector(":scope > p.note");
    if (loading) loading.remove();
    const err = document.getElementById("page-error");
    if (err) err.remove();
    RENDER[PAGE](data);
    APP.dataset.loaded = String(Number(APP.dataset.loaded || 0) + 1);
  } catch (e) {
    let err = document.getElementById("page-error");
    if (!err) { err = el("div", {id: "page-error", class: "card error"}); APP.prepend(err); }
    err.replaceChildren(el("h2", {text: e.title || "Cannot load this page"}),
                        el("p", {text: e.message}));
  }
}

async function poll() {
  try {
    const s = await getJSON(withExp("/api/stamp"));
    document.getElementById("live").classList.remove("off");
    if (s.stamp !== lastStamp) { lastStamp = s.stamp; await refresh(); }
  } catch (e) {
    document.getElementById("live").classList.add("off");
  }
  setTimeout(poll, 1000);
}

if (APP && RENDER[PAGE]) {
  for (const a of document.querySelectorAll("header nav a"))
    if (EXP && a.getAttribute("href") !== "/") a.href = withExp(a.getAttribute("href").split("?")[0]);
  refresh().then(() => setTimeout(poll, 1000));
}
