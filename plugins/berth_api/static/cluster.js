/* Cluster map: nodes grouped by topology domain (block, rack, ...), each GPU a cell coloured
 * by the team holding it. */
"use strict";

(() => {
  const { h, fill, gpus } = Berth;
  const mapEl = document.getElementById("map");
  const legendEl = document.getElementById("legend");
  const problemEl = document.getElementById("problem");

  function holderText(x) {
    const part = x.share < 1 ? ` ${gpus(x.share)} GPU` : "";
    const stopping = x.state === "preempting" ? ", stopping after preemption" : ` ${x.state}`;
    return `job ${x.job} (team ${x.team}${part},${stopping})`;
  }

  function gpuCell(node, g, colours) {
    const where = `${node.name} GPU ${g.index}`;
    const teams = [...new Set(g.holders.map((x) => x.team))];
    const attrs = {
      class: `gpu ${g.state}`,
      "data-gpu": `${node.name}/${g.index}`,
      "data-teams": teams.join(" "),
      "data-jobs": g.holders.map((x) => x.job).join(" "),
    };
    if (g.state === "free") {
      return h("div", { ...attrs, title: `${where}: free` }, h("span", { class: "idx" }, g.index));
    }
    const title = [`${where}:`, ...g.holders.map(holderText),
      g.free > 0 ? `free ${gpus(g.free)} GPU` : null].filter(Boolean).join("\n");
    if (g.state === "held") {
      const x = g.holders.find((y) => y.state !== "preempting") || g.holders[0];
      const stopping = g.holders.some((y) => y.state === "preempting");
      return h("a", { ...attrs, href: Berth.jobHref(x.job), title,
        class: `${attrs.class}${stopping ? " stopping" : ""}`,
        style: { backgroundColor: colours.get(x.team) || "#6b7280" } },
        h("span", { class: "idx" }, g.index), h("span", { class: "who" }, x.job));
    }
    // Shared: one slice per job, its height its fraction; what is left free stays plain.
    return h("div", { ...attrs, title },
      h("span", { class: "idx" }, g.index),
      h("div", { class: "slices" }, g.holders.map((x) =>
        h("a", { class: `slice${x.state === "preempting" ? " stopping" : ""}`,
          href: Berth.jobHref(x.job), title: `${where}: ${holderText(x)}`,
          style: { flexGrow: String(x.share), backgroundColor: colours.get(x.team) || "#6b7280" } },
          gpus(x.share))),
        g.free > 0 && h("span", { class: "slice free", style: { flexGrow: String(g.free) } })));
  }

  function nodeCard(node, colours) {
    const free = node.gpus.reduce((n, g) => n + g.free, 0);
    const groups = new Map();
    for (const g of node.gpus) (groups.get(g.group) || groups.set(g.group, []).get(g.group)).push(g);
    return h("div", { class: "node", "data-node": node.name },
      h("div", { class: "node-head" },
        h("span", { class: "node-name" }, node.name),
        h("span", { class: "muted" }, `${node.gpu_model} · ${gpus(free)}/${node.gpus.length} free`)),
      h("div", { class: "gpus" }, [...groups.values()].map((gs) =>
        h("div", { class: "island", title: "GPUs of one NVLink island / PCIe switch" },
          gs.map((g) => gpuCell(node, g, colours))))));
  }

  /* Nodes nested by their domains, outermost level first, in the cluster's order. */
  function domains(nodes, levels, colours) {
    if (levels.length === 0) return h("div", { class: "nodes" }, nodes.map((n) => nodeCard(n, colours)));
    const [level, ...rest] = levels;
    const by = new Map();
    for (const n of nodes) (by.get(n.domains[level]) || by.set(n.domains[level], []).get(n.domains[level])).push(n);
    return h("div", { class: `domains level-${rest.length}` }, [...by.entries()].map(([name, ns]) =>
      h("section", { class: "domain", "data-domain": name },
        h("h2", {}, h("span", { class: "level" }, level), " ", name),
        domains(ns, rest, colours))));
  }

  function legend(teams, colours) {
    return [
      teams.map((t) => Berth.teamBadge(t.team, colours)),
      h("span", { class: "team" }, h("span", { class: "swatch free" }), "free"),
      h("span", { class: "team" }, h("span", { class: "swatch shared" }), "shared (fractions)"),
      h("span", { class: "team" }, h("span", { class: "swatch stopping" }), "stopping"),
    ];
  }

  async function load() {
    const [{ teams }, { nodes }] = await Promise.all([Berth.get("teams"), Berth.get("nodes")]);
    const colours = Berth.teamColours(teams);
    const levels = nodes.length ? Object.keys(nodes[0].domains) : [];
    fill(problemEl);
    fill(legendEl, legend(teams, colours));
    fill(mapEl, nodes.length ? domains(nodes, levels, colours) : h("p", { class: "muted" }, "No nodes."));
  }

  Berth.every(load, (err) => fill(problemEl, Berth.problem(err, "the cluster map")));
})();
