"""The README's pictures of a run, in headless Chromium driven by Playwright (`docs/screenshots.sh` starts the
servers and the run, then calls this):

    python docs/screenshots.py RUN_PAGE PREFECT_REPORT OUT_DIR

RUN_PAGE: the MLflow run's address as `grpo pipeline` prints it; PREFECT_REPORT: the report artifact's page.
Chromium is the system's (`CHROMIUM`, default /usr/bin/chromium): Playwright's own download needs its CDN.
"""

import os
import sys
from pathlib import Path

from playwright.sync_api import Error as PlaywrightError
from playwright.sync_api import Page, sync_playwright

WIDTH = 1400


def settle(page: Page, url: str, text: str, draw_ms: int = 4000) -> None:
    """Open ``url`` and wait until the single-page app shows ``text`` and has drawn what it fetched (MLflow's pages
    poll their server, so the network is never idle)."""
    page.goto(url)
    page.get_by_text(text).first.wait_for(timeout=60_000)
    page.wait_for_timeout(draw_ms)  # charts draw after their data arrives


def close_assistant(page: Page) -> None:
    """MLflow 3.17 opens its assistant panel beside every page; the pictures are of the run."""
    if not page.get_by_text("MLflow Assistant").count():
        return
    try:
        page.locator("button[aria-label='Close']").last.click(timeout=3000)
        page.wait_for_timeout(500)
    except PlaywrightError:
        print("the assistant panel stays open: its close button was not found", file=sys.stderr)


def main(run_page: str, report: str, out: Path) -> None:
    base, _, query = run_page.partition("?")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=os.environ.get("CHROMIUM", "/usr/bin/chromium"))
        page = browser.new_page(viewport={"width": WIDTH, "height": 1000})
        settle(page, run_page, "Description")
        close_assistant(page)
        if (more := page.get_by_text("Show more")).count():
            more.first.click()  # the description: the report
            page.wait_for_timeout(500)
        page.screenshot(path=out / "mlflow_run.png", full_page=True)
        settle(page, f"{base}/model-metrics?{query}", "Add chart", draw_ms=15_000)
        close_assistant(page)
        page.screenshot(path=out / "mlflow_charts.png")
        page.set_viewport_size({"width": WIDTH, "height": 1100})
        settle(page, report, "Promotion")
        page.screenshot(path=out / "prefect_report.png", full_page=True)
        browser.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]))
