/* GPU queues: per team a quota bar and the jobs waiting in its queue; with an organization
 * tree, the teams under their cohorts, each cohort with what it uses of its quota. */
"use strict";

(() => {
  const { h, fill, gpus } = Berth;
  const teamsEl = document.getElementById("teams");
  const problemEl = document.getElementById("problem");

  // What a team's bar calls its numbers; a cohort's bar shows its use against its quota.
  const TEAM_TERMS = { nominal: "nominal", mark: "nominal quota", within: "within nominal",
    from: "the cohort" };

  /* Held GPUs against nominal and ceiling. The bar's scale is the ceiling, or (no borrowing
   * limit) whatever is larger of held and nominal, with room to show there is no end. */
  function quotaBar(t, colour, terms = TEAM_TERMS) {
    const nominal = t.nominal_gpus;
    const ceiling = t.ceiling_gpus;
    const top = ceiling ?? Math.max(t.held_gpus + t.stopping_gpus, nominal ?? 0, 1) * 1.25;
    const pct = (x) => `${Math.min(100, (100 * x) / top)}%`;
    const within = t.held_gpus - t.borrowed_gpus;
    const marks = [];
    if (nominal !== null) {
      marks.push(h("span", { class: "mark nominal", style: { left: pct(nominal) },
        title: `${terms.mark}: ${gpus(nominal)} GPUs` }));
    }
    const label = [
      `${gpus(t.held_gpus)} GPUs held`,
      nominal === null ? "no quota" : `${terms.nominal} ${gpus(nominal)}`,
      ceiling === null ? "borrowing unlimited" : `ceiling ${gpus(ceiling)}`,
    ].join(" · ");
    return h("div", { class: "quota" },
      h("div", { class: "bar-track", role: "img", "aria-label": label, title: label },
        h("span", { class: "seg held", style: { width: pct(within), backgroundColor: colour },
          title: `${gpus(within)} GPUs ${terms.within}` }),
        t.borrowed_gpus > 0 && h("span", { class: "seg borrowed",
          style: { width: pct(t.borrowed_gpus), backgroundColor: colour },
          title: `${gpus(t.borrowed_gpus)} GPUs borrowed from ${terms.from}` }),
        t.stopping_gpus > 0 && h("span", { class: "seg stopping",
          style: { width: pct(t.stopping_gpus) },
          title: `${gpus(t.stopping_gpus)} GPUs of preempted jobs still stopping` }),
        marks,
        ceiling === null && h("span", { class: "unbounded", title: "no borrowing limit" }, "→")),
      scale(nominal, ceiling, pct, terms.nominal));
  }

  /* The numbers under the bar; one label where nominal and ceiling would collide. */
  function scale(nominal, ceiling, pct, word = "nominal") {
    const end = ceiling === null ? "no limit" : `ceiling ${gpus(ceiling)}`;
    if (nominal === null) return h("div", { class: "scale" }, h("span", {}, "0"), h("span", { class: "end" }, end));
    if (ceiling !== null && ceiling === nominal) {
      return h("div", { class: "scale" }, h("span", {}, "0"),
        h("span", { class: "end" }, `${word} = ceiling ${gpus(nominal)} (may not borrow)`));
    }
    const near = ceiling !== null && parseFloat(pct(nominal)) > 80;
    return h("div", { class: "scale" }, h("span", {}, "0"),
      !near && h("span", { class: "at", style: { left: pct(nominal) } }, `${word} ${gpus(nominal)}`),
      h("span", { class: "end" }, near ? `${word} ${gpus(nominal)} · ${end}` : end));
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

  function teamCard(t, colours, waiting) {
    return h("section", { class: "card team-card", "data-team": t.team },
      h("h2", {}, Berth.teamBadge(t.team, colours)),
      summary(t),
      quotaBar(t, colours.get(t.team)),
      h("h3", {}, "Waiting"),
      waitingTable(waiting));
  }

  /* A cohort's row: what its children use of its pool against its quota (the engine's count:
   * a child's guaranteed part is in neither), and whether it borrows from its parent. */
  function cohortRow(c) {
    const parent = c.parent ?? "the root's pool";
    const borrows = c.borrowed_gpus > 0;
    const bar = { nominal_gpus: c.quota_gpus, ceiling_gpus: c.ceiling_gpus,
      held_gpus: c.used_gpus, borrowed_gpus: c.borrowed_gpus, stopping_gpus: 0 };
    const terms = { nominal: "quota", mark: "quota (own nominal and what its members lend it)",
      within: "used within its quota", from: parent };
    return h("div", { class: "cohort-row" },
      h("h2", {}, h("span", { class: "level" }, "cohort"), " ", c.name),
      h("p", { class: "summary" },
        h("b", { class: "cohort-used" }, `${gpus(c.used_gpus)} / ${gpus(c.quota_gpus)}`),
        " GPUs of its quota used",
        borrows
          ? [" · ", h("b", { class: "borrowed-text cohort-borrows" },
              `borrows ${gpus(c.borrowed_gpus)} from ${parent}`)]
          : [" · ", h("span", { class: "cohort-borrows" }, "within its quota")],
        h("span", { class: "muted", title: "GPUs held by the teams anywhere under it, the "
          + "parts they keep for themselves included" },
          ` · its teams hold ${gpus(c.held_gpus)}`)),
      quotaBar(bar, "#64748b", terms));
  }

  /* The teams nested under their cohorts (the API lists parents first); the root's teams
   * after the top-level cohorts. */
  function tree(cohorts, teams, card) {
    const section = (c) =>
      h("section", { class: "cohort", "data-cohort": c.name },
        cohortRow(c),
        h("div", { class: "members" },
          teams.filter((t) => t.cohorts[0] === c.name).map(card),
          cohorts.filter((k) => k.parent === c.name).map(section)));
    return [cohorts.filter((c) => c.parent === null).map(section),
      teams.filter((t) => t.cohorts.length === 0).map(card)];
  }

  async function load() {
    const [{ teams }, { jobs }, { cohorts }] = await Promise.all(
      [Berth.get("teams"), Berth.get("queue"), Berth.get("cohorts")]);
    const colours = Berth.teamColours(teams);
    const byTeam = new Map(teams.map((t) => [t.team, []]));
    for (const j of jobs) (byTeam.get(j.team) || byTeam.set(j.team, []).get(j.team)).push(j);
    const card = (t) => teamCard(t, colours, byTeam.get(t.team) || []);
    fill(problemEl);
    fill(teamsEl, cohorts.length === 0 ? teams.map(card) : tree(cohorts, teams, card));
  }

  Berth.every(load, (err) => fill(problemEl, Berth.problem(err, "the GPU queues")));
})();
