/* GPU queues: per team a quota bar and the jobs waiting in its queue. */
"use strict";

(() => {
  const { h, fill, gpus } = Berth;
  const teamsEl = document.getElementById("teams");
  const problemEl = document.getElementById("problem");

  /* Held GPUs against nominal and ceiling. The bar's scale is the ceiling, or (no borrowing
   * limit) whatever is larger of held and nominal, with room to show there is no end. */
  function quotaBar(t, colour) {
    const nominal = t.nominal_gpus;
    const ceiling = t.ceiling_gpus;
    const top = ceiling ?? Math.max(t.held_gpus + t.stopping_gpus, nominal ?? 0, 1) * 1.25;
    const pct = (x) => `${Math.min(100, (100 * x) / top)}%`;
    const within = t.held_gpus - t.borrowed_gpus;
    const marks = [];
    if (nominal !== null) {
      marks.push(h("span", { class: "mark nominal", style: { left: pct(nominal) },
        title: `nominal quota: ${gpus(nominal)} GPUs` }));
    }
    const label = [
      `${gpus(t.held_gpus)} GPUs held`,
      nominal === null ? "no quota" : `nominal ${gpus(nominal)}`,
      ceiling === null ? "borrowing unlimited" : `ceiling ${gpus(ceiling)}`,
    ].join(" · ");
    return h("div", { class: "quota" },
      h("div", { class: "bar-track", role: "img", "aria-label": label, title: label },
        h("span", { class: "seg held", style: { width: pct(within), backgroundColor: colour },
          title: `${gpus(within)} GPUs within nominal` }),
        t.borrowed_gpus > 0 && h("span", { class: "seg borrowed",
          style: { width: pct(t.borrowed_gpus), backgroundColor: colour },
          title: `${gpus(t.borrowed_gpus)} GPUs borrowed from the cohort` }),
        t.stopping_gpus > 0 && h("span", { class: "seg stopping",
          style: { width: pct(t.stopping_gpus) },
          title: `${gpus(t.stopping_gpus)} GPUs of preempted jobs still stopping` }),
        marks,
        ceiling === null && h("span", { class: "unbounded", title: "no borrowing limit" }, "→")),
      scale(nominal, ceiling, pct));
  }

  /* The numbers under the bar; one label where nominal and ceiling would collide. */
  function scale(nominal, ceiling, pct) {
    const end = ceiling === null ? "no limit" : `ceiling ${gpus(ceiling)}`;
    if (nominal === null) return h("div", { class: "scale" }, h("span", {}, "0"), h("span", { class: "end" }, end));
    if (ceiling !== null && ceiling === nominal) {
      return h("div", { class: "scale" }, h("span", {}, "0"),
        h("span", { class: "end" }, `nominal = ceiling ${gpus(nominal)} (may not borrow)`));
    }
    const near = ceiling !== null && parseFloat(pct(nominal)) > 80;
    return h("div", { class: "scale" }, h("span", {}, "0"),
      !near && h("span", { class: "at", style: { left: pct(nominal) } }, `nominal ${gpus(nominal)}`),
      h("span", { class: "end" }, near ? `nominal ${gpus(nominal)} · ${end}` : end));
  }

  function summary(t) {
    const bits = [
      h("b", {}, gpus(t.held_gpus)), " GPUs held",
      t.borrowed_gpus > 0 && [" (", h("b", { class: "borrowed-text" }, gpus(t.borrowed_gpus)),
        " borrowed)"],
      t.stopping_gpus > 0 && [" · ", gpus(t.stopping_gpus), " stopping"],
      " · ", String(t.running), " running · ", String(t.queued), " waiting",
    ];
    return h("p", { class: "summary" }, bits);
  }

  function reason(r) {
    if (!r) return h("span", { class: "muted" }, "not looked at by a cycle yet");
    return h("span", { class: "reason" },
      h("span", { class: `code code-${r.code}` }, r.code.replaceAll("_", " ")),
      r.message ? [" ", r.message] : null);
  }

  function waitingTable(jobs) {
    if (jobs.length === 0) return h("p", { class: "muted empty" }, "No jobs waiting.");
    return h("table", { class: "waiting" },
      h("thead", {}, h("tr", {},
        h("th", { class: "num" }, "#"), h("th", {}, "Job"), h("th", { class: "num" }, "GPUs"),
        h("th", { class: "num" }, "Priority"), h("th", {}, "Why it waits"),
        h("th", {}, "Waiting since"), h("th", {}, "Expected start"))),
      h("tbody", {}, jobs.map((j) =>
        h("tr", { "data-job": j.id },
          h("td", { class: "num position" }, String(j.position)),
          h("td", {}, h("a", { href: Berth.jobHref(j.id), target: "_self" }, j.name),
            j.id !== j.name && h("div", { class: "id" }, j.id)),
          h("td", { class: "num" },
            j.replicas > 1 ? `${j.replicas} × ${gpus(j.gpus_per_replica)}` : gpus(j.gpus)),
          h("td", { class: "num" }, String(j.priority)),
          h("td", { class: "why" }, reason(j.reason)),
          h("td", {}, Berth.ago(j.waiting_since)),
          h("td", {}, Berth.eta(j.eta))))));
  }

  async function load() {
    const [{ teams }, { jobs }] = await Promise.all([Berth.get("teams"), Berth.get("queue")]);
    const colours = Berth.teamColours(teams);
    const byTeam = new Map(teams.map((t) => [t.team, []]));
    for (const j of jobs) (byTeam.get(j.team) || byTeam.set(j.team, []).get(j.team)).push(j);
    fill(problemEl);
    fill(teamsEl, teams.map((t) =>
      h("section", { class: "card team-card", "data-team": t.team },
        h("h2", {}, Berth.teamBadge(t.team, colours)),
        summary(t),
        quotaBar(t, colours.get(t.team)),
        h("h3", {}, "Waiting"),
        waitingTable(byTeam.get(t.team) || []))));
  }

  Berth.every(load, (err) => fill(problemEl, Berth.problem(err, "the GPU queues")));
})();
