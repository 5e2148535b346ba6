"""Berth's pages in a real headless Chromium, against a real Airflow API server.

One Airflow API server (AirflowDeployment, as in test_plugin_api.py) loads the repository's
plugin; its store holds a small but realistic scene on a cluster of blocks and racks: four
teams, one borrowing above its nominal quota, a gang running on two nodes, two jobs sharing
one GPU in halves, and jobs waiting for quota with their positions. A second one's teams sit
in an organization tree of two levels, for the cohort rows. The browser logs in as a
user does, through Airflow's own login page (which sets the UI's `_token` cookie), then reads
and acts through the pages: the pages' own fetches carry that cookie and nothing else.

Chromium and chromedriver are Debian's, driven through tests/browser.py: without them the
tests skip, unless BERTH_REQUIRE_BROWSER=1 (CI), where they fail. Screenshots of every page go
to BERTH_TEST_ARTIFACTS (default tests/artifacts/).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
import yaml
from airflow_server import AirflowDeployment
from browser import (  # noqa: F401 (fixture)
    By,
    WebDriver,
    WebElement,
    browser_fixture,
    shot,
    until,
)
from builders import job_spec
from test_plugin_api import TREE
from waiting import wait_for

from berth.settings import BerthSettings
from berth.store import Store

REPO = Path(__file__).resolve().parent.parent


# -- the scene ----------------------------------------------------------------------------------

CLUSTER = {
    "name": "lab",
    "topology_levels": ["block", "rack"],
    "node_pools": [
        {
            "prefix": "gpu",
            "count": 6,
            "gpus": 4,
            "gpu_model": "h100",
            "gpu_groups": 2,
            "cpus": 64,
            "memory_gb": 512,
            "nodes_per_rack": 2,
            "racks_per_block": 2,
        }
    ],
}
TEAMS = {
    "teams": [
        {"name": "vision", "nominal": {"gpus": 8}, "borrowing_limit": {"gpus": 8}},
        {"name": "language", "nominal": {"gpus": 8}, "borrowing_limit": {"gpus": 4}},
        {"name": "research", "nominal": {"gpus": 4}, "borrowing_limit": {"gpus": 0}},
        {"name": "speech", "nominal": {"gpus": 4}},
    ]
}
RUN_ID = "manual__2026-03-02T09:00:00+00:00"
# A label is user input: it must show as text, never run.
HOSTILE = '<img src=x onerror="window.__berth_xss=1">'


@dataclass
class Scene:
    af: AirflowDeployment
    store: Store
    passwords: dict[str, str]


def from_dag(dag_id: str, group: str) -> dict[str, str]:
    """The labels the run task of a `gpu_job` group gives its job (operators/job.py)."""
    return {
        "dag_id": dag_id,
        "run_id": RUN_ID,
        "task_id": f"{group}.run",
        "map_index": "-1",
        "try_number": "1",
    }


def stage(store: Store) -> None:
    """Running: vision's gang (2 x 4 GPUs, two nodes) and one more job (4 borrowed), language's
    fine-tune, research's sweep, and two half-GPU jobs sharing one GPU. Waiting: research for
    its quota (it may not borrow), two jobs deep; language's pretraining beyond its ceiling."""
    running = [
        (
            "resnet-gang",
            job_spec("resnet-gang", "vision", 4, replicas=2),
            from_dag("train_resnet", "resnet"),
        ),
        ("vit-large", job_spec("vit-large", "vision", 4), {}),
        ("llm-finetune", job_spec("llm-finetune", "language", 4), {}),
        ("sweep-a", job_spec("sweep-a", "research", 2), {}),
        ("probe-a", job_spec("probe-a", "research", 0.5), {}),
        ("probe-b", job_spec("probe-b", "language", 0.5), {}),
    ]
    for job_id, s, labels in running:
        store.submit(s, job_id=job_id, labels=labels)
        store.schedule()
    for job_id, *_ in running:
        assert store.status(job_id).state == "admitted", store.status(job_id)
        store.mark_started(job_id, 1)
    store.submit(job_spec("sweep-b", "research", 2), job_id="sweep-b")
    store.submit(
        job_spec("sweep-c", "research", 2),
        job_id="sweep-c",
        labels={"dag_id": "sweeps", "note": HOSTILE},
    )
    store.submit(job_spec("llm-pretrain", "language", 4, replicas=3), job_id="llm-pretrain")
    store.schedule()
    # As the scheduling loop does now and then: with no run finished yet, each running job
    # is taken to run an hour (scheduling/eta.py), so the waiting ones start in about an hour.
    assert store.estimate_starts() == 3


def deploy(root: Path, teams: dict[str, Any], staged: Callable[[Store], None]) -> Iterator[Scene]:
    """An Airflow API server with the plugin over a store of CLUSTER and `teams`, `staged`."""
    dags = root / "dags"
    dags.mkdir()
    (root / "cluster.yaml").write_text(yaml.safe_dump(CLUSTER))
    (root / "teams.yaml").write_text(yaml.safe_dump(teams))
    berth = {
        "BERTH_HOME": str(root / "berth"),
        "BERTH_CLUSTER": str(root / "cluster.yaml"),
        "BERTH_TEAMS": str(root / "teams.yaml"),
    }
    af = AirflowDeployment(
        root,
        dags,
        root / "berth",
        extra_env={
            **berth,
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin,viewer:viewer",
        },
    )
    store = BerthSettings.from_env(berth).store()
    staged(store)
    try:
        af.migrate()
        af.start("api-server")
        af.wait_healthy(("api-server",))
        # The auth manager writes the viewer's password when the API server starts.
        file = af.home / "simple_auth_manager_passwords.json"

        def both() -> dict[str, str] | None:
            known = json.loads(file.read_text())
            return known if "viewer" in known else None

        passwords = wait_for(both, "the users' passwords", 60)
        yield Scene(af, store, passwords)
    finally:
        af.stop()
        store.close()


@pytest.fixture(scope="module")
def scene(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scene]:
    yield from deploy(tmp_path_factory.mktemp("pages"), TEAMS, stage)


# The organization tree of the API's tests (`test_plugin_api.TREE`: research > vision-lab).
TREE_TEAMS = TREE


def stage_tree(store: Store) -> None:
    """Running: cv's two jobs of 4 GPUs (4 above its nominal), speech's 1 (within the part it
    keeps), nlp's 2; ops holds nothing."""
    jobs = [("cv-1", "cv", 4), ("cv-2", "cv", 4), ("asr", "speech", 1), ("nlp-1", "nlp", 2)]
    for job_id, team, gpus in jobs:
        store.submit(job_spec(job_id, team, gpus), job_id=job_id)
        store.schedule()
        assert store.status(job_id).state == "admitted", store.status(job_id)
        store.mark_started(job_id, 1)


@pytest.fixture(scope="module")
def tree_scene(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scene]:
    yield from deploy(tmp_path_factory.mktemp("tree"), TREE_TEAMS, stage_tree)


def log_in(driver: WebDriver, scene: Scene, user: str) -> None:
    """Through Airflow's login page, as a person does: it sets the UI's `_token` cookie."""
    driver.delete_all_cookies()
    driver.get(f"{scene.af.url}/auth/login")
    form = until(driver, lambda: driver.find_elements(By.NAME, "username"), "the login form")
    form[0].send_keys(user)
    driver.find_element(By.NAME, "password").send_keys(scene.passwords[user])
    driver.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    until(driver, lambda: driver.get_cookie("_token"), "the UI's _token cookie after login")


def page(scene: Scene, path: str) -> str:
    return f"{scene.af.url}/berth/ui/{path}"


def row_of(driver: WebDriver, job_id: str) -> WebElement | None:
    rows = driver.find_elements(By.CSS_SELECTOR, f'tr[data-job="{job_id}"]')
    return rows[0] if rows else None


def gang_placement(scene: Scene) -> Any:
    return scene.store.status("resnet-gang").placement


# -- the pages ----------------------------------------------------------------------------------


def test_without_a_login_a_page_says_so(scene: Scene, browser: WebDriver) -> None:
    browser.delete_all_cookies()
    browser.get(page(scene, "queues"))
    alert = until(
        browser, lambda: browser.find_elements(By.CSS_SELECTOR, ".problem.login"), "the 401 note"
    )[0]
    assert "Not logged in to Airflow (401)" in alert.text
    login = alert.find_element(By.TAG_NAME, "a").get_attribute("href")
    assert login.startswith(f"{scene.af.url}/api/v2/auth/login?next="), login
    assert browser.find_element(By.ID, "teams").text == ""
    shot(browser, "not-logged-in")


def test_the_queue_page_shows_quota_reason_and_position(scene: Scene, browser: WebDriver) -> None:
    log_in(browser, scene, "viewer")
    browser.get(page(scene, "queues"))
    until(browser, lambda: row_of(browser, "sweep-c"), "research's second waiting job")
    b, c = row_of(browser, "sweep-b"), row_of(browser, "sweep-c")
    assert b is not None and c is not None
    for row, position in ((b, "1"), (c, "2")):
        assert row.find_element(By.CSS_SELECTOR, ".position").text == position
        why = row.find_element(By.CSS_SELECTOR, ".why").text
        assert why.startswith("QUOTA") and "research" in why, why
    expected = scene.store.status("sweep-b").reason_message
    assert expected and expected in b.text
    # The expected start: estimated (no time limits here), about an hour from now.
    eta = b.find_element(By.CSS_SELECTOR, ".eta")
    assert re.fullmatch(r"~in (5\d|6\d) min", eta.text), eta.text
    assert "estimated from run times" in (eta.get_attribute("title") or "")
    link = b.find_element(By.TAG_NAME, "a")
    assert link.get_attribute("href") == page(scene, "jobs/sweep-b")
    # Each team's bar: vision holds 12 of nominal 8 (ceiling 16), 4 of them borrowed.
    vision = browser.find_element(By.CSS_SELECTOR, 'section.team-card[data-team="vision"]')
    assert "12 GPUs held (4 borrowed)" in vision.text
    assert "nominal 8" in vision.text and "ceiling 16" in vision.text
    borrowed = vision.find_element(By.CSS_SELECTOR, ".seg.borrowed")
    assert borrowed.get_attribute("title") == "4 GPUs borrowed from the cohort"
    assert float(borrowed.value_of_css_property("width").removesuffix("px")) > 50
    speech = browser.find_element(By.CSS_SELECTOR, 'section.team-card[data-team="speech"]')
    assert "No jobs waiting." in speech.text
    # No organization tree: the teams side by side as the file lists them, no cohort rows.
    cards = browser.find_elements(By.CSS_SELECTOR, "#teams > section.team-card")
    assert [c.get_attribute("data-team") for c in cards] == [t["name"] for t in TEAMS["teams"]]
    assert browser.find_elements(By.CSS_SELECTOR, ".cohort, .cohort-row") == []
    shot(browser, "queues")


def members(cohort: WebElement, css: str, attribute: str) -> list[str | None]:
    found = cohort.find_elements(By.CSS_SELECTOR, f":scope > .members > {css}")
    return [e.get_attribute(attribute) for e in found]


def test_the_queue_page_nests_teams_under_their_cohorts(
    tree_scene: Scene, browser: WebDriver
) -> None:
    log_in(browser, tree_scene, "viewer")
    browser.get(page(tree_scene, "queues"))
    until(
        browser,
        lambda: browser.find_elements(By.CSS_SELECTOR, '.cohort[data-cohort="vision-lab"]'),
        "the vision lab's row",
    )
    (research,) = browser.find_elements(By.CSS_SELECTOR, "#teams > .cohort")
    assert research.get_attribute("data-cohort") == "research"
    assert members(research, "section.team-card", "data-team") == ["nlp"]
    assert members(research, ".cohort", "data-cohort") == ["vision-lab"]
    lab = research.find_element(By.CSS_SELECTOR, ":scope > .members > .cohort")
    assert members(lab, "section.team-card", "data-team") == ["cv", "speech"]
    assert members(lab, ".cohort", "data-cohort") == []
    root = browser.find_elements(By.CSS_SELECTOR, "#teams > section.team-card")
    assert [c.get_attribute("data-team") for c in root] == ["ops"]

    def row(cohort: WebElement) -> tuple[str, str, str]:
        r = cohort.find_element(By.CSS_SELECTOR, ":scope > .cohort-row")
        used = r.find_element(By.CSS_SELECTOR, ".cohort-used").text
        return used, r.find_element(By.CSS_SELECTOR, ".cohort-borrows").text, r.text

    # The lab: cv's 8 GPUs against its quota of 7 (its own 2, cv's 4, the 1 speech lends):
    # 1 borrowed from research. Speech's 1 GPU is within the part it keeps: held, not used.
    used, borrows, text = row(lab)
    assert (used, borrows) == ("8 / 7", "borrows 1 from research")
    assert "its teams hold 9" in text
    seg = lab.find_element(By.CSS_SELECTOR, ":scope > .cohort-row .seg.borrowed")
    assert seg.get_attribute("title") == "1 GPUs borrowed from research"
    assert "ceiling 11" in text
    # Research: the lab's 8 and nlp's 2 against nlp's 4 and the lab's 7; not borrowing.
    used, borrows, text = row(research)
    assert (used, borrows) == ("10 / 11", "within its quota")
    assert "its teams hold 11" in text and "no limit" in text
    assert research.find_elements(By.CSS_SELECTOR, ":scope > .cohort-row .seg.borrowed") == []
    cv = lab.find_element(By.CSS_SELECTOR, 'section.team-card[data-team="cv"]')
    assert "8 GPUs held (4 borrowed)" in cv.text
    shot(browser, "queues-tree")


def test_the_cluster_map_colours_each_gpu_by_its_team(scene: Scene, browser: WebDriver) -> None:
    log_in(browser, scene, "viewer")
    browser.get(page(scene, "cluster"))
    until(browser, lambda: browser.find_elements(By.CSS_SELECTOR, ".gpu.held"), "held GPUs")
    gang = scene.store.status("resnet-gang").placement
    assert len({r.node for r in gang}) == 2, gang  # a gang on two nodes
    colour = None
    for r in gang:
        for i in r.gpus:
            cell = browser.find_element(By.CSS_SELECTOR, f'[data-gpu="{r.node}/{i}"]')
            assert cell.get_attribute("data-teams") == "vision"
            assert "job resnet-gang (team vision" in cell.get_attribute("title")
            who = cell.find_element(By.CSS_SELECTOR, ".who").get_attribute("textContent")
            assert who == "resnet-gang"
            colour = colour or cell.value_of_css_property("background-color")
            assert cell.value_of_css_property("background-color") == colour
    legend = browser.find_element(By.ID, "legend")
    swatch = legend.find_element(By.CSS_SELECTOR, '[data-team="vision"] .swatch')
    assert swatch.value_of_css_property("background-color") == colour
    # Both halves of the shared GPU, each in its team's colour; free GPUs plain.
    shared = browser.find_elements(By.CSS_SELECTOR, ".gpu.shared")
    assert len(shared) == 1
    assert sorted(shared[0].get_attribute("data-teams").split()) == ["language", "research"]
    assert [s.text for s in shared[0].find_elements(By.CSS_SELECTOR, ".slice")] == ["0.5", "0.5"]
    free = browser.find_elements(By.CSS_SELECTOR, ".gpu.free")
    assert len(free) == 24 - 8 - 4 - 4 - 2 - 1
    # Nodes under their block and rack, as /nodes' domains say.
    blocks = browser.find_elements(By.CSS_SELECTOR, ".map > .domains > .domain")
    assert [b.get_attribute("data-domain") for b in blocks] == ["gpu-block0", "gpu-block1"]
    racks = blocks[0].find_elements(By.CSS_SELECTOR, ".domain")
    assert [r.get_attribute("data-domain") for r in racks] == ["gpu-rack0", "gpu-rack1"]
    shot(browser, "cluster")


def test_the_job_page_cancels_and_shows_a_refusal(scene: Scene, browser: WebDriver) -> None:
    # A viewer may read but not cancel: the page shows the API's 403 message.
    log_in(browser, scene, "viewer")
    browser.get(page(scene, "jobs/sweep-c"))
    until(browser, lambda: browser.find_elements(By.ID, "position"), "the job's position")
    assert browser.find_element(By.ID, "position").text == "2"
    text = browser.find_element(By.ID, "job").text
    assert "QUOTA" in text and "research" in text
    assert HOSTILE in text  # the label shown as text ...
    assert browser.execute_script("return window.__berth_xss") is None  # ... not run
    browser.find_element(By.ID, "cancel").click()
    browser.find_element(By.ID, "cancel-confirm").click()
    refused = until(browser, lambda: browser.find_elements(By.ID, "cancel-refused"), "refusal")[0]
    assert "Not cancelled (403)" in refused.text and "DAG 'sweeps'" in refused.text
    assert scene.store.status("sweep-c").state == "queued"
    shot(browser, "job-cancel-refused")

    log_in(browser, scene, "admin")
    browser.get(page(scene, "jobs/sweep-c"))
    until(browser, lambda: browser.find_elements(By.ID, "cancel"), "the cancel button")[0].click()
    browser.find_element(By.ID, "cancel-confirm").click()
    until(browser, lambda: "Cancelled." in browser.find_element(By.ID, "job").text, "cancelled")
    assert scene.store.status("sweep-c").state == "cancelled"
    assert browser.find_elements(By.ID, "cancel") == []  # an ended job has no cancel button
    events = [
        e.get_attribute("data-event")
        for e in browser.find_elements(By.CSS_SELECTOR, "tr[data-event]")
    ]
    assert events == ["submit", "cancel"], events
    shot(browser, "job-cancelled")

    browser.get(page(scene, "jobs/resnet-gang"))
    until(browser, lambda: "replica 1:" in browser.find_element(By.ID, "job").text, "placement")
    for r in gang_placement(scene):
        assert (
            f"{r.node} GPU {', '.join(map(str, r.gpus))}" in browser.find_element(By.ID, "job").text
        )
    airflow = browser.find_element(By.LINK_TEXT, f"task resnet.run of run {RUN_ID}")
    run = quote(RUN_ID, safe="")
    assert airflow.get_attribute("href") == (
        f"{scene.af.url}/dags/train_resnet/runs/{run}/tasks/resnet.run"
    )
    shot(browser, "job-running")


def test_a_task_instance_opens_its_job(scene: Scene, browser: WebDriver) -> None:
    """As Airflow's UI fills in the `task_instance` view's href: any task of the group."""
    log_in(browser, scene, "viewer")
    href = next(v["href"] for v in berth_views(scene) if v["destination"] == "task_instance")
    ids = {"{DAG_ID}": "train_resnet", "{RUN_ID}": RUN_ID, "{TASK_ID}": "resnet.validate"}
    for k, v in ids.items():
        href = href.replace(k, quote(v, safe=""))
    browser.get(scene.af.url + href)  # {MAP_INDEX} left in place: the task is not mapped
    until(browser, lambda: browser.current_url == page(scene, "jobs/resnet-gang"), "redirect")
    until(browser, lambda: "resnet-gang" in browser.find_element(By.ID, "job").text, "the job")

    browser.get(scene.af.url + href.replace("train_resnet", "other_dag"))
    until(browser, lambda: "No Berth job" in browser.find_element(By.ID, "found").text, "none")


# -- in Airflow's UI ----------------------------------------------------------------------------


def berth_views(scene: Scene) -> list[dict[str, Any]]:
    plugins = scene.af.api.call("GET", "/plugins")["plugins"]
    (berth,) = [p for p in plugins if p["name"] == "berth"]
    return list(berth["external_views"])


def test_the_pages_are_in_airflows_navigation(scene: Scene, browser: WebDriver) -> None:
    views = {v["name"]: v for v in berth_views(scene)}
    assert {(n, v["url_route"], v["destination"]) for n, v in views.items()} == {
        ("GPU queues", "berth-queues", "nav"),
        ("Cluster map", "berth-cluster", "nav"),
        ("Berth job", "berth-job", "task_instance"),
    }
    assert views["GPU queues"]["href"] == "/berth/ui/queues"
    for v in views.values():
        assert (
            httpx.get(scene.af.url + v["icon"], timeout=30, follow_redirects=True).status_code
            == 200
        )

    # The nav entry opens the page inside Airflow's UI, whose cookie the page's fetches use.
    log_in(browser, scene, "viewer")
    browser.get(f"{scene.af.url}/")
    link = until(
        browser,
        lambda: browser.find_elements(By.CSS_SELECTOR, 'a[href$="/plugin/berth-queues"]'),
        "GPU queues in Airflow's navigation",
    )[0]
    assert browser.find_elements(By.CSS_SELECTOR, 'a[href$="/plugin/berth-cluster"]')
    link.click()
    frame = until(
        browser,
        lambda: browser.find_elements(By.CSS_SELECTOR, 'iframe[title="GPU queues"]'),
        "frame",
    )[0]
    browser.switch_to.frame(frame)
    try:
        until(browser, lambda: row_of(browser, "sweep-b"), "the queue inside Airflow's UI")
    finally:
        browser.switch_to.default_content()
    shot(browser, "airflow-ui-queues")
