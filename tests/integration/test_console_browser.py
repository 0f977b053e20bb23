"""The web console in a real headless browser (Debian's chromium driven by Playwright), against one
stack for the module with every service in its own process: log in, run the fork/join example from
the catalog and watch the join turn green, the timeline in log order, time travel to before the join,
a wait answered from its form, a 100,000-iteration loop's page (timed) and its cancellation. Each page
is saved as a screenshot under test-output/console/ for review."""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from noetl_mesh.infra.embedded import EmbeddedNats
from noetl_mesh.infra.nats_auth import NatsAuth
from noetl_mesh.stack import ProcessStack, Settings

from playwright.sync_api import sync_playwright

from conftest import LoopThread

ROOT = Path(__file__).resolve().parents[2]
SHOTS = ROOT / "test-output" / "console"
CHROMIUM = os.environ.get("NOETL_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
PASSWORD = "correct horse battery staple 7"
LOOP_ITEMS = 100_000

APPROVAL = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: approval, path: console/approval}
workflow:
  - step: start
    tool: {kind: noop, result: {amount: 120}}
    next: {arcs: [{step: approve}]}
  - step: approve
    tool:
      - name: ask
        kind: wait
        signal: approve
        timeout: 1h
        assignee: finance
        form: {ok: checkbox}
        schema: {type: object, required: [ok], properties: {ok: {type: boolean}}}
    next: {arcs: [{step: book, when: "{{ approve.result.payload.ok }}"}]}
  - step: book
    tool: {kind: noop, result: booked}
"""

BIG_LOOP = f"""
apiVersion: noetl.io/v2
kind: Playbook
metadata: {{name: big_loop, path: console/big_loop}}
workflow:
  - step: start
    loop:
      in: "{{{{ range({LOOP_ITEMS}) | list }}}}"
      iterator: i
      spec: {{mode: parallel, max_in_flight: 256}}
    tool: {{kind: noop, result: "{{{{ iter.i }}}}"}}
    next: {{arcs: [{{step: report, when: "{{{{ event.name == 'loop.done' }}}}"}}]}}
  - step: report
    tool: {{kind: noop, result: done}}
"""


class Console:
    def __init__(self, url: str, token: str, page, admin_token: str):
        self.url, self.token, self.page = url, token, page
        self.http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, trust_env=False, timeout=30)
        self.admin_token = admin_token
        self.admin = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {admin_token}"}, trust_env=False,
                                  timeout=30)

    def shot(self, name: str, full: bool = False) -> None:
        SHOTS.mkdir(parents=True, exist_ok=True)
        self.page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=full)

    def go(self, route: str) -> None:
        self.page.goto(f"{self.url}/ui/#{route}")

    def wait_api(self, check, timeout: float = 60):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:  # the test waits for the stack; the page never polls
            value = check()
            if value:
                return value
            time.sleep(0.2)
        raise AssertionError("timed out")


@pytest.fixture(scope="module")
def console(module_pg, throwaway_credential_key) -> Iterator[Console]:
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: apt-get install -y chromium (the CI script does)")
    creds = tempfile.mkdtemp(prefix="noetl-console-creds-")
    logs = tempfile.mkdtemp(prefix="noetl-console-logs-")
    auth = NatsAuth(creds).ensure()
    nats = EmbeddedNats(auth=auth).start()
    loop = LoopThread()
    stack = ProcessStack(Settings(nats_url=nats.url, pg_dsn=module_pg, nats_creds=creds, concurrency=16), log_dir=logs)
    loop.run(stack.start(), timeout=120)
    playwright = browser = None
    try:
        admin = httpx.Client(base_url=stack.gateway_url, headers={"Authorization": f"Bearer {stack.token}"},
                             trust_env=False, timeout=30)
        assert admin.post("/api/users", json={"username": "ann", "password": PASSWORD, "roles": ["developer"],
                                              "display_name": "Ann"}).status_code == 201
        for text in ((ROOT / "examples" / "fork_join.yaml").read_text(), APPROVAL, BIG_LOOP):
            assert admin.post("/api/catalog", json={"content": text}).status_code == 201
        assert admin.post("/api/credentials", json={"name": "warehouse", "kind": "postgres", "data": {
            "password": "s3cret-value-never-shown"}, "description": "the reporting database",
            "users": ["ann"]}).status_code == 201
        ann = httpx.post(f"{stack.gateway_url}/api/auth/login", json={"username": "ann", "password": PASSWORD},
                         trust_env=False).json()["token"]
        playwright = sync_playwright().start()
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1440, "height": 1000})
        page.set_default_timeout(20_000)
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
        yield Console(stack.gateway_url, ann, page, stack.token)
        # uncaught errors and the page's own console errors; not the statuses it handles (a 404 while an
        # execution just started is not recorded yet, the 401 of a wrong password)
        assert not [e for e in errors if not e.startswith("Failed to load resource")], errors
    finally:
        if browser is not None:
            browser.close()
        if playwright is not None:
            playwright.stop()
        loop.run(stack.stop(), timeout=60)
        loop.close()
        violations = nats.violations()
        nats.stop()
        shutil.rmtree(creds, ignore_errors=True)
        shutil.rmtree(logs, ignore_errors=True)
    assert not violations, violations


def test_log_in_keyboard_and_contrast(console):
    page = console.page
    console.go("/executions")
    page.wait_for_selector("form.login")
    console.shot("01-login")
    page.click("button[type=submit]")  # nothing filled in: said, not sent
    page.wait_for_selector("#login-status.error:text('a username and a password, or an API token')")
    assert page.evaluate("document.activeElement.id") == "username"
    page.fill("#username", "ann")
    page.fill("#password", "wrong password")
    page.click("button[type=submit]")
    page.wait_for_selector("#login-status.error")
    page.fill("#password", PASSWORD)
    page.keyboard.press("Enter")  # the form by keyboard
    page.wait_for_selector("#nav a[data-section=executions][aria-current]")
    assert "ann (developer)" in page.inner_text("#nav")
    # keyboard: a page puts the focus on its content; back from there, every section, then the skip link
    page.wait_for_function("() => document.activeElement.id === 'main'")  # once the page is drawn
    visited = []
    for _ in range(11):
        page.keyboard.press("Shift+Tab")
        visited.append(page.evaluate("document.activeElement.textContent"))
    # a developer's menu: no Users, no Audit (user.admin, audit.read)
    assert visited == ["Log out", "Sessions", "Tokens", "Credentials", "Catalog", "Schedules", "Waits", "Executions",
                       "Overview", "noetlmesh", "Skip to content"], visited
    for _ in range(9):
        page.keyboard.press("Tab")
    page.keyboard.press("Enter")  # Sessions
    page.wait_for_selector("#sessions tr.current")
    page.wait_for_selector("#sessions tr.current")
    console.shot("05-sessions")
    page.click("#nav a[data-section=credentials]")
    page.wait_for_selector("#credentials")
    assert "warehouse" in page.inner_text("#credentials") and "postgres" in page.inner_text("#credentials")
    assert "admin, user ann" in page.inner_text("#credentials")  # who may use it (D24): a role, a user
    assert "s3cret" not in page.content()
    console.shot("06-credentials")
    low = page.evaluate(CONTRAST)
    assert low == [], low


def test_fork_join_from_the_catalog_the_join_the_timeline_and_time_travel(console):
    page = console.page
    page.click("#nav a[data-section=catalog]")
    page.click("#catalog a:text('examples/fork_join')")
    page.wait_for_selector("#preview-net g.node[data-step=report].join")
    assert page.locator("#yaml li").count() == len((ROOT / "examples" / "fork_join.yaml").read_text().split("\n"))
    assert page.evaluate(CONTRAST) == []
    console.shot("03-catalog-entry")
    page.click("#run")
    page.wait_for_url("**/ui/#/executions/*")
    eid = page.url.rsplit("/", 1)[-1]
    page.wait_for_selector("#net g.node[data-step=report][data-status=done]")  # the join turned green
    for branch in ("eu", "us"):
        assert page.get_attribute(f"#net g.node[data-step={branch}]", "data-status") == "done"
    assert page.get_attribute("#net g.node[data-step=apac]", "data-status") == "idle"  # its `when` was false
    assert "join" in page.get_attribute("#net g.node[data-step=report]", "class")
    page.wait_for_selector("#exec-status [data-status=completed]")
    # the timeline: every event, in log order
    total = console.http.get(f"/api/executions/{eid}/events", params={"limit": 1}).json()["total"]
    page.wait_for_function(f"() => document.querySelectorAll('#timeline tr.event').length === {total}")
    rows = page.eval_on_selector_all("#timeline tr.event", "rs => rs.map(r => [r.dataset.name, Number(r.dataset.seq), r.children[3].textContent])")
    seqs = [seq for _, seq, _ in rows]
    assert seqs == sorted(seqs) and len(set(seqs)) == total
    assert rows[0][0] == "playbook.execution.requested" and rows[-1][0] == "playbook.processed"
    names = [n for n, _, _ in rows]
    assert names.index("workflow.started") < names.index("workflow.finished")
    # the Gantt chart: a row for each step run, in admission order; a branch's task attempt under it
    page.wait_for_function("() => document.querySelectorAll('#gantt .g-row.level-0').length === 4")
    steps = page.eval_on_selector_all("#gantt .g-row.level-0", "rs => rs.map(r => r.dataset.step)")
    assert steps[0] == "start" and steps[-1] == "report" and sorted(steps[1:3]) == ["eu", "us"], steps
    tl = console.http.get(f"/api/executions/{eid}/timeline").json()
    eu = next(r for r in tl["runs"] if r["step"] == "eu")
    assert page.get_attribute(f"#gantt .g-row[data-run='{eu['run_id']}']", "data-status") == "done"
    page.click(f"#gantt .g-row[data-run='{eu['run_id']}'] .g-toggle")
    attempt = page.wait_for_selector("#gantt .g-row.level-1[data-task]")
    assert "attempt 1" in attempt.inner_text()
    # zoom: in halves the window, Fit shows the whole execution again (once the chart has read its end)
    page.wait_for_selector("#gantt[data-end]:not([data-end=''])")
    assert page.get_attribute("#gantt-chart", "data-zoomed") == "false"
    whole = page.inner_text("#gantt-range")
    assert whole.startswith("0 to +")
    page.click("#gantt-in")
    page.wait_for_selector("#gantt-chart[data-zoomed=true]")
    assert page.inner_text("#gantt-range") != whole
    assert page.evaluate("() => document.querySelector('#gantt .g-row[data-step=report] .g-bar[data-run]').style.width") != ""
    page.click("#gantt-fit")
    page.wait_for_selector("#gantt-chart[data-zoomed=false]")
    assert page.inner_text("#gantt-range").startswith("0 to +")
    # a task row filters the events to that task
    page.click("#gantt .g-row.level-1[data-task] .g-name")
    page.wait_for_function("() => document.getElementById('tl-task').value !== ''")
    page.wait_for_function("() => [...document.querySelectorAll('#timeline tr.event')].every(r => r.dataset.step === 'eu')")
    page.click("#timeline-panel button:text('Clear')")
    page.wait_for_function(f"() => document.querySelectorAll('#timeline tr.event').length === {total}")
    # keyboard: a step opens its detail, with when each run was admitted, started and ended
    page.focus("#net g.node[data-step=report]")
    page.keyboard.press("Enter")
    page.wait_for_selector("#step-detail article.run")
    assert '"total_orders": 200' in page.inner_text("#step-detail")
    report = next(r for r in tl["runs"] if r["step"] == "report")
    times = page.inner_text("#step-detail .run-times")
    for key in ("admitted", "started", "ended", "duration"):
        assert key in times, times
    shown = page.inner_text("#step-detail .run-duration")
    assert shown.endswith(("ms", " s")) and "so far" not in shown, shown
    page.click("#step-detail details.tasks-box summary")
    row = page.wait_for_selector("#step-detail table.attempts tbody tr[data-task]")
    assert row.query_selector(".attempt-duration").inner_text().endswith(("ms", " s"))
    assert report["ended_at"] >= report["started_at"]
    assert page.evaluate(CONTRAST) == []
    # no edge is drawn across an arc's label: what is seen across each label's text is the label
    crossed = page.evaluate(LABELS_CROSSED)
    assert crossed == {"labels": 6, "crossed": []}, crossed
    # the net's panel ends where the step's detail does: no empty space opens under the net
    gap = page.evaluate("() => document.getElementById('step-detail').getBoundingClientRect().bottom"
                        " - document.getElementById('net-panel').getBoundingClientRect().bottom")
    assert abs(gap) <= 2, gap
    console.shot("04-execution")
    # time travel: the state after the events before the join's admission
    before = next(i for i, (n, _, step) in enumerate(rows) if n == "step.admitted" and step == "report")
    page.focus("#tt")
    page.keyboard.press("Home")
    for _ in range(before):
        page.keyboard.press("ArrowRight")
    page.wait_for_function(f"() => document.getElementById('tt-label').textContent.startsWith('after event {before} ')")
    page.wait_for_selector("#net g.node[data-step=report][data-status=waiting]")
    # the head tells the status at that point, marked past, not the live one
    page.wait_for_selector("#exec-status [data-status=running]")
    assert page.is_visible("#exec-past") and page.get_attribute(".live-dot", "data-state") == "past"
    assert "time travel" in page.inner_text(".live-dot")
    marker = page.get_attribute("#gantt .g-marker", "style") or ""
    assert "left" in marker and not page.eval_on_selector("#gantt .g-marker", "m => m.hidden")
    for branch in ("eu", "us"):
        assert page.get_attribute(f"#net g.node[data-step={branch}]", "data-status") == "done"
    assert page.locator("#net .edge .token[visibility=visible]").count() == 2  # a token on each of its places
    console.shot("07-time-travel-before-the-join")
    page.click("#tt-live")
    page.wait_for_selector("#net g.node[data-step=report][data-status=done]")
    page.wait_for_selector("#exec-status [data-status=completed]")
    assert page.locator("#exec-past").count() == 0 and page.get_attribute(".live-dot", "data-state") == "live"


def test_a_wait_answered_from_its_form_moves_the_net_live(console):
    page = console.page
    page.click("#nav a[data-section=catalog]")
    page.click("#catalog a:text('console/approval')")
    page.click("#run")
    page.wait_for_url("**/ui/#/executions/*")
    form = page.wait_for_selector("form.signal[data-signal=approve]")
    # waiting for its signal: drawn waiting (yellow), not running. The form comes from the waits' list
    # and the net from the execution's state, two reads: on a loaded machine the net may show the wait
    # one live update after the form does
    node = page.wait_for_selector("#net g.node[data-step=approve][data-status=waiting]")
    assert "waiting" in node.get_attribute("aria-label")
    # the events, although the page was opened before the execution was recorded
    page.wait_for_selector("#timeline tr.event[data-name='wait.started']")
    # the chart: the run waiting, its wait under it (open: it reaches to now); no duration below zero
    page.wait_for_function("() => [...document.querySelectorAll('#gantt .g-dur')].every(d => !d.textContent.startsWith('-'))")
    page.wait_for_selector("#gantt .g-row.level-0[data-step=approve][data-status=waiting]")
    page.click("#gantt .g-row.level-0[data-step=approve] .g-toggle")
    page.wait_for_selector("#gantt .g-row.level-1[data-task=ask] .g-bar.wait")
    # the form comes from the wait's schema: `ok` a checkbox, required; no JSON to write
    box = form.query_selector("input[type=checkbox][name=ok]")
    assert box is not None and not box.is_checked()
    assert form.query_selector("[data-field=ok] .req") is not None
    assert not [t for t in form.query_selector_all("textarea") if t.is_visible()]
    box.check()
    # "As JSON" shows the same payload, and back
    form.query_selector("button[data-mode=json]").click()
    assert form.query_selector(".json-box textarea").input_value().replace(" ", "").replace("\n", "") == '{"ok":true}'
    form.query_selector("button[data-mode=form]").click()
    assert form.query_selector("input[type=checkbox][name=ok]").is_checked()
    assert page.evaluate(CONTRAST) == []
    console.shot("08-wait-form")
    form.query_selector("button[type=submit]").click()
    page.wait_for_selector("#net g.node[data-step=book][data-status=done]")  # no reload: the live stream
    page.wait_for_selector("#exec-status [data-status=completed]")


FLAKY = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: flaky, path: console/flaky}
workload: {broken: true}
workflow:
  - step: load
    tool: {kind: noop, result: {rows: 120}}
    next: {arcs: [{step: transform}]}
  - step: transform
    tool: {kind: noop, result: "{{ load.result.rows * 2 }}"}
    next: {arcs: [{step: publish}]}
  - step: publish
    tool:
      kind: noop
      result: "published {{ transform.result }}"
      spec: {policy: {rules: [{when: "{{ workload.broken }}", then: {do: fail}}, {else: {then: {do: continue}}}]}}
    next: {arcs: [{step: notify}]}
  - step: notify
    tool: {kind: noop, result: sent}
"""


def test_a_failed_step_is_restarted_from_its_detail(console):
    """D32: "restart from here" on a failed step; the new execution carries the steps before it over."""
    page = console.page
    assert console.http.post("/api/catalog", json={"content": FLAKY}).status_code == 201
    eid = console.http.post("/api/executions", json={"path": "console/flaky"}).json()["execution_id"]

    def failed():
        resp = console.http.get(f"/api/executions/{eid}", params={"brief": "true"})
        return resp.status_code == 200 and resp.json()["status"] == "FAILED"

    console.wait_api(failed)
    console.go(f"/executions/{eid}")
    page.wait_for_selector("#net g.node[data-step=publish][data-status=failed]")
    page.focus("#net g.node[data-step=publish]")
    page.keyboard.press("Enter")
    page.wait_for_selector("form.restart-form[data-step=publish]")
    page.fill("#restart-workload", '{"broken": false}')
    assert page.evaluate(CONTRAST) == []
    console.shot("11-restart-from-here")
    page.click("#restart-from")
    page.wait_for_function(f"() => /^#\\/executions\\/[0-9a-f]+$/.test(location.hash) && !location.hash.endsWith('{eid}')")
    new = page.url.rsplit("/", 1)[-1]
    page.wait_for_selector("#exec-status [data-status=completed]")
    page.wait_for_selector("#net g.node[data-step=notify][data-status=done]")
    for step in ("load", "transform"):  # carried over, not run again
        assert page.get_attribute(f"#net g.node[data-step={step}]", "data-restored") == "true"
        assert page.get_attribute(f"#net g.node[data-step={step}]", "data-runs") == "0"
    assert page.get_attribute("#net g.node[data-step=publish]", "data-runs") == "1"
    assert eid[:8] in page.inner_text("#restarted-from") and "publish" in page.inner_text("#restarted-from")
    page.focus("#net g.node[data-step=load]")
    page.keyboard.press("Enter")
    page.wait_for_selector("#step-detail p.restored")
    assert page.evaluate(CONTRAST) == []
    console.shot("12-restarted", full=True)
    page.click("#restarted-from a")  # the old execution lists its restarts
    page.wait_for_selector(f"#restarts a[href='#/executions/{new}']")
    assert page.get_attribute("#net g.node[data-step=publish]", "data-status") == "failed"  # never changed


INLINE = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: inline_double, path: console/inline_double}
workflow:
  - step: double
    tool: {kind: noop, result: "{{ workload.n * 2 }}"}
"""


def test_run_again_with_an_edited_workload_and_find_it_by_its_id(console):
    page = console.page
    eid = console.http.post("/api/executions", json={"path": "console/flaky"}).json()["execution_id"]

    def failed():
        resp = console.http.get(f"/api/executions/{eid}", params={"brief": "true"})
        return resp.status_code == 200 and resp.json()["status"] == "FAILED"

    console.wait_api(failed)
    console.go(f"/executions/{eid}")
    page.wait_for_selector("#exec-status [data-status=failed]")
    page.click("#rerun")
    box = page.wait_for_selector("#rerun-workload")
    assert '"broken": true' in box.input_value()  # this execution's workload, to edit
    assert page.input_value("#rerun-version") == "same"
    page.fill("#rerun-workload", "[1, 2]")
    page.click("#rerun-start")
    page.wait_for_selector("#rerun-status:text('a JSON object')")
    page.fill("#rerun-workload", '{"broken": false}')
    assert page.evaluate(CONTRAST) == []
    console.shot("15-run-again")
    page.click("#rerun-start")
    page.wait_for_function(f"() => /^#\\/executions\\/[0-9a-f]+$/.test(location.hash) && !location.hash.endsWith('{eid}')")
    new = page.url.rsplit("/", 1)[-1]
    page.wait_for_selector("#exec-status [data-status=completed]")
    again = console.http.get(f"/api/executions/{new}").json()
    assert again["path"] == "console/flaky" and again["workload"]["broken"] is False
    # an inline playbook (none in the catalog) runs again from the document its first event holds
    inline = console.http.post("/api/executions", json={"playbook": INLINE, "workload": {"n": 2}}).json()["execution_id"]
    console.go(f"/executions/{inline}")
    page.wait_for_selector("#exec-status [data-status=completed]")
    page.click("#rerun")
    page.wait_for_selector("#rerun-workload")
    assert page.locator("#rerun-version").count() == 0
    page.fill("#rerun-workload", '{"n": 5}')
    page.click("#rerun-start")
    page.wait_for_function(f"() => /^#\\/executions\\/[0-9a-f]+$/.test(location.hash) && !location.hash.endsWith('{inline}')")
    page.wait_for_selector("#exec-status [data-status=completed]")
    page.wait_for_selector("#net g.node[data-step=double][data-status=done]")
    twice = console.http.get(f"/api/executions/{page.url.rsplit('/', 1)[-1]}").json()
    assert twice["workload"] == {"n": 5} and console.http.get("/api/catalog", params={"path": "console/inline_double"}).json() == []
    # the executions page finds it by the start of its id, and only it
    console.go("/executions")
    page.wait_for_selector("#executions tbody tr[data-execution]")
    page.fill("#f-id", new[:10])
    page.press("#f-id", "Enter")
    page.wait_for_function(f"() => [...document.querySelectorAll('#executions tbody tr[data-execution]')].map(r => r.dataset.execution).join() === '{new}'")
    assert "id=" + new[:10] in page.url
    page.fill("#f-id", "no such id!")
    page.press("#f-id", "Enter")
    page.wait_for_selector("#executions-message:text('letters, digits')")


def test_a_100000_iteration_loop_renders_fast_as_counts_and_is_cancelled_from_its_page(console):
    page = console.page
    entry = next(e for e in console.http.get("/api/catalog", params={"path": "console/big_loop"}).json())
    eid = console.http.post("/api/executions", json={"catalog_id": entry["id"]}).json()["execution_id"]

    def progress():
        state = console.http.get(f"/api/executions/{eid}/state")
        if state.status_code != 200:
            return None
        shown = state.json()["runs"].get("start", {}).get("shown") or [{}]
        loop = shown[-1].get("loop") or {}
        return loop if (loop.get("done") or 0) >= 5_000 else None

    console.wait_api(progress, timeout=120)
    console.go("/executions")
    page.wait_for_selector("#executions tbody tr")
    assert page.evaluate(CONTRAST) == []
    console.shot("02-executions")
    started = time.perf_counter()
    console.go(f"/executions/{eid}")
    page.wait_for_function("""() => {
        const t = document.querySelector('#net g.node[data-step=start] .node-loop');
        return t && /\\/100,000/.test(t.textContent) && document.querySelectorAll('#timeline tr.event').length === 100;
    }""")
    took = time.perf_counter() - started  # a figure to read, not to assert (bench/ measures; this checks the shape)
    print(f"\nthe page of a {LOOP_ITEMS:,}-iteration loop rendered in {took:.2f} s")
    first = int(page.get_attribute("#loop-progress", "data-done"))
    page.wait_for_function(f"() => Number(document.getElementById('loop-progress').dataset.done) > {first}")  # live
    assert page.locator("#timeline tr.event").count() == 100  # a page of events, never the 400,000 rows
    # the chart: the loop as iterations ended per slice of time, not a bar per iteration
    page.wait_for_selector("#gantt .g-row.level-0[data-step=start] .g-hist rect.done")
    assert page.locator("#gantt .g-hist rect").count() <= 2 * 120
    assert page.locator("#gantt .g-row").count() == 1
    console.shot("09-loop-100k")
    page.click("#cancel")
    page.click("#cancel-confirm")
    page.wait_for_selector("#exec-status [data-status=cancelled]", timeout=60_000)
    assert page.get_attribute("#net g.node[data-step=start]", "data-status") == "cancelled"
    done = int(page.get_attribute("#loop-progress", "data-done"))
    assert 0 < done < LOOP_ITEMS
    console.shot("10-loop-cancelled")


BEST_EFFORT_LOOP = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: best_effort_loop, path: console/best_effort_loop}
workflow:
  - step: each
    spec: {policy: {failure: {mode: best_effort}}}
    loop: {in: "{{ workload.items }}", iterator: i}
    tool:
      kind: noop
      result: "{{ iter.i }}"
      spec: {policy: {rules: [{when: "{{ iter.i < 0 }}", then: {do: fail}}, {else: {then: {do: continue}}}]}}
"""


def test_a_loop_whose_iterations_failed_is_not_drawn_green(console):
    """best_effort: every iteration failed is drawn failed (red); some failed, partial (orange); the
    execution itself completed."""
    page = console.page
    assert console.http.post("/api/catalog", json={"content": BEST_EFFORT_LOOP}).status_code == 201
    for items, status in (([-1, -2, -3], "failed"), ([-1, 2, 3], "partial")):
        eid = console.http.post("/api/executions", json={"path": "console/best_effort_loop",
                                                         "workload": {"items": items}}).json()["execution_id"]
        console.go(f"/executions/{eid}")
        page.wait_for_selector("#exec-status [data-status=completed]")
        page.wait_for_selector(f"#net g.node[data-step=each][data-status={status}]")
        fill = page.eval_on_selector("#net g.node[data-step=each] .node-box", "r => getComputedStyle(r).fill")
        done = page.eval_on_selector(".legend .chip.st-done", "c => getComputedStyle(c).backgroundColor")
        assert fill != done, (status, fill)
        page.focus("#net g.node[data-step=each]")
        page.keyboard.press("Enter")
        page.wait_for_selector(f"#step-detail article.run .badge[data-status={status}]")
        assert page.evaluate(CONTRAST) == []
    console.shot("13-loop-partial")


def test_the_overview_counts_what_the_api_counts(console):
    page = console.page
    page.click("#nav a[data-section=overview]")
    page.wait_for_selector("#ov-totals .ov-total[data-status=ALL]")
    stats = console.http.get("/api/stats/executions", params={"buckets": 48}).json()
    for status, n in stats["totals"].items():
        if n:
            assert page.inner_text(f"#ov-totals .ov-total[data-status={status}] strong") == f"{n:,}", status
    assert stats["totals"].get("COMPLETED") and stats["totals"].get("FAILED")  # the tests before made both
    slices = page.locator("#ov-chart g.ov-slice").count()
    assert slices == 48 and page.locator("#ov-chart g.ov-slice rect.ov-completed").count() >= 1
    assert page.locator("#ov-chart g.ov-slice rect.ov-failed").count() >= 1
    paths = page.eval_on_selector_all("#ov-slowest tbody tr[data-path]", "rs => rs.map(r => r.dataset.path)")
    assert paths == [p["path"] for p in stats["slowest"]] and "examples/fork_join" in paths
    kinds = page.eval_on_selector_all("#ov-failures tbody tr[data-kind]", "rs => rs.map(r => r.dataset.kind)")
    assert kinds == [f["kind"] or "" for f in stats["failures"]] and kinds
    latest = stats["failures"][0]["latest_execution"]
    assert page.locator(f"#ov-failures a[href='#/executions/{latest}']").count() == 1
    assert page.evaluate(CONTRAST) == []
    console.shot("16-overview", full=True)
    page.select_option("#ov-range", "1h")
    page.wait_for_function("() => document.querySelectorAll('#ov-chart g.ov-slice').length === 12")
    assert "range=1h" in page.url


RESTRICTED = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: restricted, path: console/restricted}
workflow:
  - step: start
    tool:
      - name: ask
        kind: wait
        signal: sign_off
        roles: [admin]
        form: {note: text}
"""


RICH_FORM = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: rich_form, path: console/rich_form}
workflow:
  - step: start
    tool:
      - name: ask
        kind: wait
        signal: details
        form: {comment: textarea}
        schema:
          type: object
          required: [priority, count]
          properties:
            priority: {type: string, enum: [low, high], title: "<b>Priority</b>"}
            count: {type: integer, minimum: 1}
            comment: {type: string}
            deep: {type: object, properties: {a: {type: object, properties: {b: {type: object, properties: {
              c: {type: object, properties: {d: {type: object, properties: {e: {type: boolean}}}}}}}}}}}
"""


def test_a_wait_form_from_a_richer_schema_checks_before_sending(console):
    page = console.page
    assert console.http.post("/api/catalog", json={"content": RICH_FORM}).status_code == 201
    eid = console.http.post("/api/executions", json={"path": "console/rich_form"}).json()["execution_id"]
    console.go(f"/executions/{eid}")
    form = page.wait_for_selector("form.signal[data-signal=details]")
    fields = form.eval_on_selector_all(".form-box > .fields > [data-field]", "fs => fs.map(f => f.dataset.field)")
    assert fields[:2] == ["priority", "count"] and set(fields) == {"priority", "count", "comment", "deep"}, fields
    assert form.query_selector("select[name=priority]") is not None  # an enum: a list to choose from
    assert form.query_selector("input[type=number][name=count]").get_attribute("min") == "1"
    assert form.query_selector("textarea[name=comment]") is not None  # the form hint: a long text
    assert "<b>Priority</b>" in form.inner_text() and not form.query_selector("b")  # a title is text
    assert form.query_selector("[data-field='deep.a.b.c'] textarea") is not None  # too deep: JSON for it
    form.query_selector("button[type=submit]").click()
    page.wait_for_selector("form.signal[data-signal=details] .signal-status[data-state=error]")
    assert "priority is required" in form.query_selector(".signal-status").inner_text()
    form.query_selector("select[name=priority]").select_option(label="high")
    form.query_selector("input[name=count]").fill("3")
    form.query_selector("textarea[name=comment]").fill("line one\nline two")
    assert page.evaluate(CONTRAST) == []
    console.shot("22-wait-rich-form")
    form.query_selector("button[type=submit]").click()
    page.wait_for_selector("#exec-status [data-status=completed]")
    signal = next(e for e in console.http.get(f"/api/executions/{eid}/events", params={"limit": 1000}).json()["events"]
                  if e["name"] == "signal.received")
    payload = signal["data"]["payload"]
    assert payload == {"priority": "high", "count": 3, "comment": "line one\nline two",
                       "deep": {"a": {"b": {}}}}, payload


def test_the_waits_inbox_lists_what_the_user_may_answer_with_its_form(console):
    page = console.page
    assert console.http.post("/api/catalog", json={"content": RESTRICTED}).status_code == 201
    mine = console.http.post("/api/executions", json={"path": "console/approval"}).json()["execution_id"]
    other = console.http.post("/api/executions", json={"path": "console/restricted"}).json()["execution_id"]

    def waiting():
        rows = console.admin.get("/api/waits").json()
        return {w["execution_id"] for w in rows} >= {mine, other}

    console.wait_api(waiting)
    page.click("#nav a[data-section=waits]")
    item = page.wait_for_selector(f"#waits article[data-execution='{mine}']")
    assert page.locator(f"#waits article[data-execution='{other}']").count() == 0  # roles [admin]: not hers
    assert item.query_selector(f"a[href='#/executions/{mine}']") is not None
    box = item.query_selector("input[type=checkbox][name=ok]")
    box.check()
    assert page.evaluate(CONTRAST) == []
    console.shot("17-waits")
    item.query_selector("button[type=submit]").click()
    page.wait_for_selector(f"#waits article[data-execution='{mine}'] .signal-status[data-state=sent]")

    def completed():
        return console.http.get(f"/api/executions/{mine}", params={"brief": "true"}).json()["status"] == "COMPLETED"

    console.wait_api(completed)
    page.click("#waits-refresh")
    page.wait_for_function(f"() => !document.querySelector(\"#waits article[data-execution='{mine}']\")")
    assert console.admin.post(f"/api/executions/{other}/cancel").status_code == 202


def test_schedules_listed_paused_and_resumed_where_the_user_may(console):
    page = console.page
    mine = console.http.post("/api/schedules", json={"path": "console/approval", "every": "6h", "name": "ann-six-hourly"})
    assert mine.status_code == 201, mine.text
    theirs = console.admin.post("/api/schedules", json={"path": "examples/fork_join", "cron": "0 0 3 * * *",
                                                        "timezone": "Europe/Paris", "name": "admin-nightly"})
    assert theirs.status_code == 201, theirs.text
    try:
        page.click("#nav a[data-section=schedules]")
        row = page.wait_for_selector("#schedules tr[data-schedule=ann-six-hourly][data-status=active]")
        assert "every 6 h" in row.inner_text()
        other = page.wait_for_selector("#schedules tr[data-schedule=admin-nightly]")
        assert "Europe/Paris" in other.inner_text()
        assert other.query_selector("button") is None  # another user's: ann may not pause it (execution.cancel.any)
        other.query_selector("details.fires-box summary").click()
        page.wait_for_function("() => document.querySelectorAll('#schedules tr[data-schedule=admin-nightly] ol.fires li').length === 10")
        assert page.evaluate(CONTRAST) == []
        console.shot("18-schedules")
        row.query_selector("button[data-action=pause]").click()
        page.wait_for_selector("#schedules tr[data-schedule=ann-six-hourly][data-status=paused] button[data-action=resume]")
        assert console.http.get("/api/schedules/ann-six-hourly").json()["paused"] is True
        page.click("#schedules tr[data-schedule=ann-six-hourly] button[data-action=resume]")
        page.wait_for_selector("#schedules tr[data-schedule=ann-six-hourly][data-status=active] button[data-action=pause]")
        assert console.http.get("/api/schedules/ann-six-hourly").json()["paused"] is False
    finally:
        console.admin.delete("/api/schedules/ann-six-hourly")
        console.admin.delete("/api/schedules/admin-nightly")


def test_admin_pages_users_tokens_and_audit_and_none_for_a_developer(console):
    page = console.page
    for section in ("users", "audit"):  # ann is a developer: not in her menu, and the page says why
        assert page.locator(f"#nav a[data-section={section}]").count() == 0
        console.go(f"/{section}")
        page.wait_for_selector("#forbidden")
        assert ("user.admin" if section == "users" else "audit.read") in page.inner_text("#forbidden")
    admin = page.context.browser.new_page(viewport={"width": 1440, "height": 1000})
    errors: list[str] = []
    admin.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        admin.goto(f"{console.url}/ui/#/users")
        admin.click("form.login details summary")
        admin.fill("#api-token", console.admin_token)
        admin.click("form.login button[type=submit]")
        admin.wait_for_selector("#users tr[data-user=ann]")
        for section in ("users", "audit", "tokens"):
            assert admin.locator(f"#nav a[data-section={section}]").count() == 1
        # a user added from the form; what it typed is shown as text
        admin.fill("#nu-name", "bob")
        admin.fill("#nu-display", "<img src=x id=pwned>")
        admin.fill("#nu-password", PASSWORD)
        admin.click("#new-user button[type=submit]")
        bob = admin.wait_for_selector("#users tr[data-user=bob]")
        assert "<img src=x id=pwned>" in bob.inner_text() and admin.locator("#pwned").count() == 0
        bob_id = next(u for u in console.admin.get("/api/users").json() if u["username"] == "bob")["user_id"]
        admin.check(f"#roles-{bob_id}-operator")
        admin.uncheck(f"#roles-{bob_id}-viewer")
        admin.click("#users tr[data-user=bob] button[data-action=roles]")
        admin.wait_for_selector("#users-status:text('Roles of bob set')")
        assert next(u for u in console.admin.get("/api/users").json() if u["username"] == "bob")["roles"] == ["operator"]
        admin.click("#users tr[data-user=bob] button[data-action=disable]")
        admin.wait_for_selector("#users tr[data-user=bob][data-disabled=true]")
        assert admin.evaluate(CONTRAST) == []
        admin.screenshot(path=str(SHOTS / "19-users.png"))
        # an API token: shown once, listed by name, revoked
        admin.click("#nav a[data-section=tokens]")
        admin.fill("#tk-name", "ci-deploy")
        admin.check("#tk-role-viewer")
        admin.click("#token-form button[type=submit]")
        token = admin.wait_for_selector("#token-value").input_value()
        assert token.startswith("noetl_t_")
        who = httpx.get(f"{console.url}/api/auth/whoami", headers={"Authorization": f"Bearer {token}"}, trust_env=False).json()
        assert who["roles"] == ["viewer"]
        row = admin.wait_for_selector("#tokens tr[data-name=ci-deploy]")
        assert token not in admin.inner_text("#tokens")
        row.query_selector("button[data-action=revoke]").click()
        admin.wait_for_selector("#tokens-status:text('ci-deploy revoked')")
        admin.wait_for_function("() => !document.querySelector('#tokens tr[data-name=ci-deploy]')")
        assert httpx.get(f"{console.url}/api/auth/whoami", headers={"Authorization": f"Bearer {token}"},
                         trust_env=False).status_code == 401
        # the audit log: what was just done, filtered by area
        admin.click("#nav a[data-section=audit]")
        admin.wait_for_selector("#audit tbody tr[data-action]")
        admin.fill("#au-action", "user")
        admin.press("#au-action", "Enter")
        admin.wait_for_function("() => { const a = [...document.querySelectorAll('#audit tbody tr[data-action]')].map(r => r.dataset.action);"
                                " return a.length && a.every(x => x.startsWith('user.')) && a.includes('user.disabled') && a.includes('user.added'); }")
        assert "bob" in admin.inner_text("#audit")
        assert admin.evaluate(CONTRAST) == []
        admin.screenshot(path=str(SHOTS / "21-audit.png"))
    finally:
        admin.close()
    assert not errors, errors


# Each arc label of the net: the elements seen at points along its text's middle line (none may be an
# edge's line); how many labels there are.
LABELS_CROSSED = """() => {
  const out = { labels: 0, crossed: [] };
  for (const text of document.querySelectorAll('#net text.edge-label')) {
    out.labels++;
    const r = text.getBoundingClientRect();
    for (let i = 1; i < 20; i++) {
      const el = document.elementFromPoint(r.left + (r.width * i) / 20, r.top + r.height / 2);
      if (el && el.closest('.edge')) out.crossed.push(text.textContent);
    }
  }
  return out;
}"""


FAILING = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: failing, path: console/failing}
workflow:
  - step: start
    tool:
      kind: python
      code: |
        def deeper(n):
            raise KeyError("missing <b>key</b> " + str(n))
        deeper(7)
"""


def test_a_traceback_reads_as_lines_not_a_json_string(console):
    page = console.page
    assert console.http.post("/api/catalog", json={"content": FAILING}).status_code == 201
    eid = console.http.post("/api/executions", json={"path": "console/failing"}).json()["execution_id"]
    console.go(f"/executions/{eid}")
    page.wait_for_selector("#exec-status [data-status=failed]")
    page.wait_for_selector("#net g.node[data-step=start][data-status=failed]")
    page.focus("#net g.node[data-step=start]")
    page.keyboard.press("Enter")
    block = page.wait_for_selector("#step-detail article.run pre .multiline")
    text = block.text_content()
    lines = text.split("\n")
    assert len(lines) >= 3 and any("Traceback" in ln for ln in lines), text
    assert any("deeper" in ln for ln in lines) and "\\n" not in text, text
    assert "missing <b>key</b> 7" in page.inner_text("#step-detail")  # as text, never markup
    assert page.locator("#step-detail b").count() == 0
    row = page.wait_for_selector("#gantt .g-row.level-0[data-step=start][data-status=failed]")
    assert "⟳" not in row.inner_text()  # not drawn as a loop
    assert page.evaluate(CONTRAST) == []
    console.shot("14-traceback")


# The text colours of the main pages against what is behind them: WCAG contrast of at least 4.5:1.
CONTRAST = """() => {
  const lum = (c) => { const [r, g, b] = c.map(v => { v /= 255; return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; });
                       return 0.2126 * r + 0.7152 * g + 0.0722 * b; };
  const rgb = (s) => (s.match(/[\\d.]+/g) || []).map(Number);
  const bg = (el) => { for (; el; el = el.parentElement) { const c = rgb(getComputedStyle(el).backgroundColor);
                        if (c.length === 3 || (c.length === 4 && c[3] > 0.5)) return c.slice(0, 3); } return [255, 255, 255]; };
  const ratio = (a, b) => { const [x, y] = [lum(a), lum(b)].sort((p, q) => q - p); return (x + 0.05) / (y + 0.05); };
  const low = [];
  for (const el of document.querySelectorAll('body *')) {
    if (!el.childNodes.length || ![...el.childNodes].some(n => n.nodeType === 3 && n.textContent.trim())) continue;
    if (el.closest('svg') || el.offsetParent === null) continue;
    const r = ratio(rgb(getComputedStyle(el).color).slice(0, 3), bg(el));
    if (r < 4.5) low.push(`${el.tagName}.${el.className}: ${r.toFixed(2)} "${el.textContent.trim().slice(0, 30)}"`);
  }
  return low;
}"""


def test_an_unknown_execution_id_says_so_instead_of_waiting_forever(console):
    page = console.page
    console.go(f"/executions/{'ab' * 16}")
    page.wait_for_selector("#exec-banner")
    assert "Waiting for the execution's first events" in page.inner_text("#exec-banner")  # maybe just started
    page.wait_for_selector("#exec-banner[data-state=unknown]", timeout=30_000)  # then: it is not known here
    assert f"No execution {'ab' * 16} is known to this stack" in page.inner_text("#exec-banner")
    assert page.get_attribute(".live-dot", "data-state") == "unknown"
    assert page.inner_text(".live-dot") == "not found"


def test_the_api_docs_render_under_their_policy(console):
    """/docs (Swagger UI) and /redoc in the browser, under their Content-Security-Policy: each renders
    the API, no script or style is refused (Swagger UI's inline start-up script passes by its hash), and
    nothing is asked of another origin (ReDoc's footer logo, on a CDN, is the one thing refused)."""
    page = console.page.context.browser.new_page(viewport={"width": 1280, "height": 900})
    page.add_init_script("window.__csp = []; document.addEventListener('securitypolicyviolation', "
                         "e => window.__csp.push([e.effectiveDirective, e.blockedURI]))")
    errors: list[str] = []
    requested: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("request", lambda req: requested.append(req.url))
    failed: dict[str, str | None] = {}
    page.on("requestfailed", lambda req: failed.__setitem__(req.url, req.failure))
    try:
        for path, rendered in (("/docs", ".opblock-summary-path"), ("/redoc", "[data-section-id] h2")):
            resp = page.goto(f"{console.url}{path}")
            assert "script-src 'self'" in resp.headers["content-security-policy"], path
            page.wait_for_selector(rendered, timeout=30_000)
            assert "/api/executions" in page.inner_text("body"), path  # the routes are listed
            page.wait_for_timeout(500)  # late work (ReDoc's search worker) has its chance to be refused
            refused = page.evaluate("window.__csp")
            expected = [["img-src", "https://cdn.redoc.ly/redoc/logo-mini.svg"]] if path == "/redoc" else []
            assert refused == expected, (path, refused)
            page.screenshot(path=str(SHOTS / f"20-api{path.replace('/', '-')}.png"))
        assert not errors, errors
        outside = {u: failed.get(u) for u in requested if not u.startswith((console.url, "data:", "blob:"))}
        assert set(outside.values()) <= {"csp"}, outside  # refused by the policy: never sent
    finally:
        page.close()
