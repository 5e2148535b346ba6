/* One job: state, why it waits or where it runs, attempts, outcome, history; cancel. */
"use strict";

(() => {
  const { h, fill, gpus } = Berth;
  const jobEl = document.getElementById("job");
  const problemEl = document.getElementById("problem");
  const jobId = decodeURIComponent(location.pathname.replace(/\/+$/, "").split("/").pop());
  const ENDED = new Set(["succeeded", "failed", "cancelled", "rejected"]);
  let confirming = false; // the cancel button asks once more before it posts
  let cancelNote = null; // what the last cancel said (refused: the API's message)
  let last = null;
  let colours = new Map();

  function row(label, ...value) {
    return [h("dt", {}, label), h("dd", {}, value)];
  }

  function placement(p) {
    if (!p) return "—";
    return h("div", {},
      p.level && h("div", { class: "muted" }, `within one ${p.level}`),
      h("ul", { class: "plain" }, p.replicas.map((r, i) =>
        h("li", {}, `replica ${i}: `, h("b", {}, r.node), ` GPU ${r.gpus.join(", ")}`,
          r.share !== null ? ` (${gpus(r.share)} of a GPU)` : ""))));
  }

  function outcome(o) {
    if (!o) return "—";
    return [h("b", {}, o.outcome), o.exit_code !== null ? ` · exit code ${o.exit_code}` : "",
      o.message ? [" · ", o.message] : ""];
  }

  function eventData(data) {
    return Object.entries(data).map(([k, v]) =>
      h("span", { class: "kv" }, h("span", { class: "k" }, k), "=",
        typeof v === "string" ? v : JSON.stringify(v)));
  }

  function labels(ls) {
    const entries = Object.entries(ls);
    if (entries.length === 0) return "—";
    return h("div", {}, entries.map(([k, v]) =>
      h("span", { class: "kv" }, h("span", { class: "k" }, k), "=", v)));
  }

  /* The DAG run (and task) that submitted the job, in Airflow's UI. */
  function airflowLink(ls) {
    const parts = ["dags", ls.dag_id];
    if (ls.run_id) parts.push("runs", ls.run_id);
    if (ls.run_id && ls.task_id) parts.push("tasks", ls.task_id);
    const href = Berth.airflowHref(parts);
    const what = ls.task_id && ls.run_id ? `task ${ls.task_id} of run ${ls.run_id}`
      : ls.run_id ? `run ${ls.run_id}` : `DAG ${ls.dag_id}`;
    return h("a", { href, target: "_top" }, what);
  }

  function cancelBox(job) {
    if (ENDED.has(job.state)) return h("div", { class: "actions" }, cancelNote);
    const ask = h("button", { type: "button", class: "danger", id: "cancel",
      onclick: () => { confirming = true; cancelNote = null; render(); } }, "Cancel job…");
    const yes = h("button", { type: "button", class: "danger", id: "cancel-confirm",
      onclick: () => cancel(yes) }, "Yes, cancel it");
    const no = h("button", { type: "button", id: "cancel-keep",
      onclick: () => { confirming = false; render(); } }, "Keep it");
    return h("div", { class: "actions" },
      confirming ? [h("span", {}, `Cancel ${job.name}? Its GPUs go to the next job. `), yes, no]
        : ask,
      cancelNote);
  }

  async function cancel(button) {
    button.disabled = true;
    try {
      last = await Berth.post(`jobs/${encodeURIComponent(jobId)}/cancel`);
      cancelNote = h("div", { class: "note ok", role: "status" }, "Cancelled.");
    } catch (err) {
      const refused = err instanceof Berth.HttpError && [403, 404, 409].includes(err.status);
      cancelNote = h("div", { class: "problem", role: "alert", id: "cancel-refused" },
        h("strong", {}, refused ? `Not cancelled (${err.status}). ` : "Not cancelled. "),
        err.message);
      if (err.status === 401) cancelNote = Berth.problem(err, "this job");
    }
    confirming = false;
    render();
  }

  function render() {
    const j = last;
    if (!j) return;
    document.title = `${j.name} · Berth`;
    const queued = j.state === "queued";
    fill(jobEl,
      h("h1", {}, j.name, " ", Berth.stateBadge(j.state)),
      j.id !== j.name && h("p", { class: "id" }, j.id),
      cancelBox(j),
      h("section", { class: "card" },
        h("dl", { class: "facts" },
          row("Team", Berth.teamBadge(j.team, colours)),
          row("State", Berth.stateBadge(j.state)),
          queued && row("Why it waits", j.reason
            ? [h("span", { class: `code code-${j.reason.code}` }, j.reason.code.replaceAll("_", " ")),
              j.reason.message ? [" ", j.reason.message] : ""]
            : h("span", { class: "muted" }, "not looked at by a cycle yet")),
          queued && row("Position", h("b", { id: "position" }, String(j.position)),
            ` in team ${j.team}'s queue`),
          queued && row("Expected start", Berth.eta(j.eta)),
          row("Placement", placement(j.placement)),
          j.waits_for.length > 0 && row("Waits for", j.waits_for.join(", "), " to stop"),
          row("Asks for", `${j.replicas} × ${gpus(j.gpus_per_replica)} GPU`,
            ` · topology ${j.topology} · priority ${j.priority}`,
            j.demoted ? " (demoted: it had its share of service; its team's jobs of this priority go first)" : ""),
          row("Attempts", String(j.attempts), j.preemptions ? ` · preempted ${j.preemptions}×` : ""),
          row("Last outcome", outcome(j.outcome)),
          row("Submitted", Berth.when(j.submitted_at)),
          j.admitted_at && row("Admitted", Berth.when(j.admitted_at)),
          j.started_at && row("Started", Berth.when(j.started_at)),
          j.finished_at && row("Finished", Berth.when(j.finished_at)),
          j.labels.dag_id && row("In Airflow", airflowLink(j.labels)),
          row("Labels", labels(j.labels)))),
      h("h2", {}, "History"),
      h("table", { class: "history" },
        h("thead", {}, h("tr", {}, h("th", {}, "Time"), h("th", {}, "Event"), h("th", {}, "Details"))),
        h("tbody", {}, j.events.map((e) =>
          h("tr", { "data-event": e.type },
            h("td", {}, Berth.when(e.time)), h("td", {}, h("b", {}, e.type)),
            h("td", {}, eventData(e.data)))))));
  }

  async function load() {
    const [j, { teams }] = await Promise.all([
      Berth.get(`jobs/${encodeURIComponent(jobId)}`),
      Berth.get("teams"),
    ]);
    fill(problemEl);
    colours = Berth.teamColours(teams);
    last = j;
    if (!confirming) render(); // a refresh must not pull the confirmation from under a click
  }

  Berth.every(load, (err) => fill(problemEl, Berth.problem(err, `job ${jobId}`)));
})();
