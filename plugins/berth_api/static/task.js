/* The Berth job of an Airflow task instance: Airflow's UI opens this page with the task's
 * ids; it finds the job by its labels and opens the job's page. */
"use strict";

(() => {
  const { h, fill } = Berth;
  const q = new URLSearchParams(location.search);
  const ask = {
    dag_id: q.get("dag_id"),
    run_id: q.get("run_id"),
    task_id: q.get("task_id"),
    // Airflow leaves "{MAP_INDEX}" in place for a task that is not mapped.
    map_index: /^-?\d+$/.test(q.get("map_index") || "") ? q.get("map_index") : null,
  };
  const foundEl = document.getElementById("found");
  const problemEl = document.getElementById("problem");
  const updated = document.getElementById("updated");

  function list(jobs) {
    return h("ul", { class: "plain" }, jobs.map((j) =>
      h("li", {}, h("a", { href: Berth.jobHref(j.id) }, j.name), " ", Berth.stateBadge(j.state),
        h("span", { class: "muted" }, ` ${j.team} · task ${j.task_id || "?"}`))));
  }

  async function find() {
    if (!ask.dag_id || !ask.run_id) {
      fill(foundEl, h("p", {}, "Open this page from a task instance in Airflow's UI."));
      return;
    }
    const { jobs } = await Berth.get("jobs", ask);
    if (jobs.length === 1) {
      location.replace(Berth.jobHref(jobs[0].id));
      return;
    }
    fill(updated, "");
    if (jobs.length > 1) {
      fill(foundEl, h("h1", {}, "Berth jobs of this task"), list(jobs));
      return;
    }
    const ofRun = (await Berth.get("jobs", { dag_id: ask.dag_id, run_id: ask.run_id })).jobs;
    fill(foundEl,
      h("h1", {}, "No Berth job"),
      h("p", {}, `Task ${ask.task_id} of run ${ask.run_id} (DAG ${ask.dag_id}) has not submitted `
        + "a Berth job: it is not in a gpu_job group, or its run task has not started yet."),
      ofRun.length > 0 && [h("p", {}, "The Berth jobs of this DAG run:"), list(ofRun)]);
  }

  find().catch((err) => {
    fill(updated, "");
    fill(problemEl, Berth.problem(err, "the job of this task"));
  });
})();
