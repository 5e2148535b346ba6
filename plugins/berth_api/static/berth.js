/* Berth pages: what every page shares. Plain JavaScript, no build step (decision 0015).
 *
 * Text from the API (job names, ids, labels, messages) only ever reaches the page as text
 * nodes or attribute values through `h()`: never through innerHTML.
 */
"use strict";

const Berth = (() => {
  // The pages live at <root>ui/..., their scripts at <root>ui/static/: everything is found
  // from where the browser loaded this script, so any base URL or proxy prefix works.
  const ROOT = new URL("../../", document.currentScript.src);
  const API = new URL("api/v1/", ROOT);
  const REFRESH_MS = 5000;

  class HttpError extends Error {
    constructor(status, detail) {
      super(detail);
      this.status = status;
    }
  }

  function url(path, params) {
    const u = new URL(path, API);
    for (const [k, v] of Object.entries(params || {})) {
      if (v !== undefined && v !== null && v !== "") u.searchParams.set(k, v);
    }
    return u;
  }

  async function call(method, path, params) {
    // The session is Airflow's UI cookie, sent by the browser on same-origin requests.
    const r = await fetch(url(path, params), {
      method,
      credentials: "same-origin",
      headers: { Accept: "application/json" },
    });
    if (!r.ok) {
      let detail = r.statusText;
      try {
        const body = await r.json();
        detail = typeof body.detail === "string" ? body.detail : JSON.stringify(body.detail);
      } catch (_) {
        /* not JSON: keep the status text */
      }
      throw new HttpError(r.status, detail);
    }
    return r.json();
  }

  const get = (path, params) => call("GET", path, params);
  const post = (path) => call("POST", path);

  /* h("a", {href: u, class: "x"}, "text", child): an element; strings become text nodes. */
  function h(tag, attrs, ...children) {
    const el = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === undefined || v === null || v === false) continue;
      if (k === "style") Object.assign(el.style, v);
      else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
      else el.setAttribute(k, v === true ? "" : String(v));
    }
    append(el, children);
    return el;
  }

  function append(el, children) {
    for (const c of children.flat(Infinity)) {
      if (c === undefined || c === null || c === false) continue;
      el.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return el;
  }

  function fill(el, ...children) {
    el.replaceChildren();
    return append(el, children);
  }

  const jobHref = (id) => new URL(`ui/jobs/${encodeURIComponent(id)}`, ROOT).href;
  const pageHref = (name) => new URL(`ui/${name}`, ROOT).href;
  // Airflow's UI lives at the base URL, one level above this plugin's prefix.
  const airflowHref = (parts) =>
    new URL(`../${parts.map(encodeURIComponent).join("/")}`, ROOT).href;

  // Inside Airflow's UI (an iframe of the same origin) Airflow's navigation is the menu.
  if (window.top !== window) document.documentElement.classList.add("framed");

  function loginHref() {
    // Airflow's own redirect to whichever auth manager's login page, back here after.
    const u = new URL("../api/v2/auth/login", ROOT);
    let back = location.href;
    try {
      back = window.top.location.href; // inside Airflow's UI: back to the UI, not the frame
    } catch (_) {
      /* a frame of another origin: this page */
    }
    u.searchParams.set("next", back);
    return u.href;
  }

  /* What went wrong, in words a user can act on. */
  function problem(err, what) {
    if (err instanceof HttpError && err.status === 401) {
      return h("div", { class: "problem login", role: "alert" },
        h("strong", {}, "Not logged in to Airflow (401). "),
        `Berth shows ${what} to Airflow users only. `,
        h("a", { href: loginHref(), target: "_top" }, "Log in to Airflow"),
        ", then come back to this page.");
    }
    if (err instanceof HttpError && err.status === 403) {
      return h("div", { class: "problem", role: "alert" },
        h("strong", {}, "Not allowed (403). "), err.message);
    }
    if (err instanceof HttpError) {
      return h("div", { class: "problem", role: "alert" },
        h("strong", {}, `Could not load ${what} (${err.status}). `), err.message);
    }
    return h("div", { class: "problem", role: "alert" },
      h("strong", {}, `Cannot reach Berth's API. `), String(err.message || err),
      " Retrying.");
  }

  /* Runs `load` now and every few seconds; a 401 or 403 stops it (reloading will not help
   * until the user logs in). `onError` shows what went wrong. */
  function every(load, onError) {
    const status = document.getElementById("updated");
    async function tick() {
      try {
        await load();
        if (status) fill(status, `Updated ${new Date().toLocaleTimeString()}`);
        if (status) status.classList.remove("stale");
      } catch (err) {
        onError(err);
        if (status) status.classList.add("stale");
        if (err instanceof HttpError && (err.status === 401 || err.status === 403)) return;
      }
      setTimeout(tick, REFRESH_MS);
    }
    tick();
  }

  // Team colours: the same team has the same colour on every page (its place among the
  // configured teams, by name), readable with white text.
  const PALETTE = [
    "#2563eb", "#d97706", "#059669", "#db2777", "#7c3aed",
    "#0891b2", "#b91c1c", "#4d7c0f", "#9333ea", "#c2410c",
  ];

  function teamColours(teams) {
    const names = teams.map((t) => t.team).sort();
    return new Map(names.map((n, i) => [n, PALETTE[i % PALETTE.length]]));
  }

  function gpus(x) {
    if (x === null || x === undefined) return "∞";
    return Number.isInteger(x) ? String(x) : String(Math.round(x * 100) / 100);
  }

  function when(iso) {
    if (!iso) return "—";
    const t = new Date(iso);
    return h("time", { datetime: iso, title: t.toString() }, t.toLocaleString());
  }

  function ago(iso) {
    const s = Math.max(0, (Date.now() - new Date(iso).getTime()) / 1000);
    const text =
      s < 90 ? `${Math.round(s)} s ago`
      : s < 5400 ? `${Math.round(s / 60)} min ago`
      : s < 172800 ? `${Math.round(s / 3600)} h ago`
      : `${Math.round(s / 86400)} days ago`;
    return h("time", { datetime: iso, title: new Date(iso).toString() }, text);
  }

  // An expected start: "in 25 min" (or "now" when due), its basis and when it was computed
  // in the title; a job without one: "not known".
  function eta(e) {
    if (!e) return h("span", { class: "muted eta" }, "not known");
    const s = (new Date(e.at).getTime() - Date.now()) / 1000;
    const text =
      s < 60 ? "now"
      : s < 5400 ? `in ${Math.round(s / 60)} min`
      : s < 172800 ? `in ${Math.round(s / 3600)} h`
      : `in ${Math.round(s / 86400)} days`;
    const basis = e.basis === "limits" ? "from time limits" : "estimated from run times";
    return h("time", {
      class: "eta", datetime: e.at,
      title: `${new Date(e.at).toString()} (${basis}; computed ${new Date(e.computed_at).toString()}; assumes no job that goes first arrives)`,
    }, e.basis === "limits" ? text : `~${text}`);
  }

  function teamBadge(team, colours) {
    return h("span", { class: "team", "data-team": team },
      h("span", { class: "swatch", style: { background: colours.get(team) || "#6b7280" } }),
      team);
  }

  function stateBadge(state) {
    return h("span", { class: `state state-${state}` }, state);
  }

  return {
    HttpError, get, post, h, fill, every, problem, teamColours, gpus, when, ago, eta,
    teamBadge, stateBadge, jobHref, pageHref, airflowHref,
  };
})();
