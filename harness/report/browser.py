"""Open a rendered report in a real browser (the system's Chromium through Selenium) and check every page.

Checks on the page source (``"<table" in html``) passed while every page showed its own markup as text, so
the report is checked as a reader sees it: each page is loaded in headless Chromium from disk, and the
check reads what the browser made of it — the visible text (``document.body.innerText``), the decoded
images (``naturalWidth``), the table DOM (headers; no table wider than its box or the page; no table pandas
cut to "N rows × M columns"; no pandas row numbers shown as a column; no float noise such as ``-2.22e-16``), the
figures' layout checks the notebooks showed under any figure that failed them
(`analysis.notebook.figure_layout_problems`: overlapping labels, a legend on the data, a share's axis not from
zero), the browser console and the page's global scope (a planted
payload sets ``window.__pwned`` if it ever runs). A full-width screenshot of each page is kept beside the
report (``report/screenshots/<page>.png``) for a person to look at.

Chromium is the Debian package (``make install`` installs it when missing and run as root); Selenium is
pointed at ``/usr/bin/chromium`` and ``/usr/bin/chromedriver`` because Selenium Manager cannot download a
browser here. Selenium is a development dependency (the ``dev`` extra), imported only when a check runs.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvscope.harness.common.errors import KvscopeError

__all__ = ["PageCheck", "check_report_pages", "chromium_paths", "report_pages"]

SCREEN_WIDTH_PX = 1280
MAX_SCREENSHOT_HEIGHT_PX = 30_000
PAGE_LOAD_TIMEOUT_S = 60

# The report's own structural markup. Untrusted data may legitimately show `<script>` or `<img …>` as text
# (that is the escaping working), so those two are not in the list; double escaping (`&lt;`) is.
ESCAPED_MARKUP = re.compile(
    r"<\s*/?\s*(h[1-6]|table|thead|tbody|tr|th|td|style|div|span|p|ul|ol|li|figure|figcaption|pre|code|br)\b[^>]*>"
    r"|&(lt|gt|amp|quot);",
    re.IGNORECASE)

# A table cell that is float noise: a number within 1e-9 of zero written in exponent form (``-2.22e-16``), or a
# binary-fraction tail (``0.30000000000000004``).
FLOAT_NOISE = re.compile(r"^[-+]?\d(\.\d+)?e-(0*(9|[1-9]\d+))$|^[-+]?\d*\.\d*(0{6,}|9{6,})\d$", re.IGNORECASE)

# What pandas prints under a table it cut to `display.max_rows` / `max_columns`.
TRUNCATED_TABLE = re.compile(r"\d[\d,]* rows × \d[\d,]* columns")

_PAGE_FACTS_JS = """
return {
  text: document.body ? document.body.innerText : '',
  images: Array.from(document.images).map(i => ({src: (i.getAttribute('src') || '').slice(0, 80),
                                                 complete: i.complete, width: i.naturalWidth})),
  tables: document.querySelectorAll('table').length,
  headless_tables: Array.from(document.querySelectorAll('table')).filter(t => !t.querySelector('th')).length,
  // a table wider than the box it sits in (its output area, or the report's table box) or than the page
  overflowing_tables: Array.from(document.querySelectorAll('table')).map((t, i) => {
    const box = t.closest('.kvs-table') || t.closest('.jp-OutputArea-output') || t.parentElement;
    const width = t.getBoundingClientRect().width, right = t.getBoundingClientRect().right;
    const page = document.documentElement.clientWidth;
    return (width > box.clientWidth + 1 || right > page + 1)
      ? `table ${i + 1}: ${Math.round(width)} px in a ${box.clientWidth} px box` : null;
  }).filter(x => x !== null),
  // pandas' row numbers shown as a column: an empty corner header over integer row headers
  index_columns: Array.from(document.querySelectorAll('table')).map((t, i) => {
    const corner = t.querySelector('thead tr th');
    const rows = Array.from(t.querySelectorAll('tbody tr'));
    const heads = rows.map(r => r.firstElementChild).filter(c => c && c.tagName === 'TH');
    return (corner && corner.innerText.trim() === '' && rows.length && heads.length === rows.length &&
            heads.every(h => /^\\d+$/.test(h.innerText.trim()))) ? `table ${i + 1}` : null;
  }).filter(x => x !== null),
  cells: Array.from(document.querySelectorAll('td')).map(c => c.innerText.trim()),
  layout_problems: Array.from(document.querySelectorAll('.kvs-layout-problem')).map(p => p.innerText),
  pwned: typeof window.__pwned !== 'undefined',
  height: Math.max(document.body ? document.body.scrollHeight : 0, document.documentElement.scrollHeight),
};
"""


@dataclass
class PageCheck:
    """What the browser made of one report page."""

    page: str
    screenshot: Path
    images: int
    tables: int
    escaped_markup: list[str] = field(default_factory=list)  # raw markup found in the visible text
    broken_images: list[str] = field(default_factory=list)  # src (first 80 characters) of images not decoded
    tables_without_headers: int = 0
    overflowing_tables: list[str] = field(default_factory=list)  # tables wider than their box or the page
    truncated_tables: list[str] = field(default_factory=list)  # pandas' "N rows × M columns" of a cut table
    console_errors: list[str] = field(default_factory=list)
    script_ran: bool = False  # window.__pwned was set: a planted payload executed
    index_columns: list[str] = field(default_factory=list)  # tables showing pandas' row numbers as a column
    float_noise: list[str] = field(default_factory=list)  # cells such as -2.22e-16
    figure_layout: list[str] = field(default_factory=list)  # the notebooks' figure layout checks that failed
    visible_text: str = field(default="", repr=False)  # document.body.innerText

    @property
    def problems(self) -> list[str]:
        out = []
        if self.escaped_markup:
            out.append(f"{len(self.escaped_markup)} escaped tags in the visible text, e.g. {self.escaped_markup[:3]}")
        if self.broken_images:
            out.append(f"images not loaded: {self.broken_images[:3]}")
        if self.tables_without_headers:
            out.append(f"{self.tables_without_headers} of {self.tables} tables without header cells")
        if self.overflowing_tables:
            out.append(f"{len(self.overflowing_tables)} tables wider than their box, e.g. {self.overflowing_tables[:3]}")
        if self.truncated_tables:
            out.append(f"{len(self.truncated_tables)} truncated tables ({self.truncated_tables[:3]})")
        if self.console_errors:
            out.append(f"console errors: {self.console_errors[:3]}")
        if self.script_ran:
            out.append("a script planted in the data ran (window.__pwned is set)")
        if self.index_columns:
            out.append(f"row numbers shown as a column in {', '.join(self.index_columns[:3])}")
        if self.float_noise:
            out.append(f"{len(self.float_noise)} table cells of float noise, e.g. {self.float_noise[:3]}")
        if self.figure_layout:
            out.append(f"{len(self.figure_layout)} figure layout problems, e.g. {self.figure_layout[:3]}")
        return [f"{self.page}: {p}" for p in out]


def chromium_paths() -> tuple[Path, Path]:
    """The system Chromium and its driver (``KVSCOPE_CHROMIUM`` / ``KVSCOPE_CHROMEDRIVER`` override)."""
    browser = os.environ.get("KVSCOPE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    driver = os.environ.get("KVSCOPE_CHROMEDRIVER") or shutil.which("chromedriver") or "/usr/bin/chromedriver"
    missing = [p for p in (browser, driver) if not Path(p).is_file()]
    if missing:
        raise KvscopeError(f"Chromium not found ({', '.join(missing)}): run `make install` as root, or "
                           "`apt-get install -y chromium chromium-driver`")
    return Path(browser), Path(driver)


def report_pages(report_dir: Path) -> list[Path]:
    """index.html first, then every notebook page of the report."""
    index = report_dir / "index.html"
    if not index.is_file():
        raise KvscopeError(f"{report_dir}: no index.html (run `kvscope report` first)")
    return [index, *sorted(p for p in report_dir.glob("*.html") if p.name != "index.html")]


def _driver() -> Any:
    try:
        from selenium import webdriver  # optional: selenium may be absent, the ImportError is handled

        # optional: selenium may be absent, the ImportError is handled
        from selenium.webdriver.chrome.service import Service
    except ImportError as exc:
        raise KvscopeError("selenium is not installed: pip install -e '.[dev]'") from exc
    browser, driver = chromium_paths()
    options = webdriver.ChromeOptions()
    options.binary_location = str(browser)
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--no-first-run", "--disable-extensions", f"--window-size={SCREEN_WIDTH_PX},900"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    d = webdriver.Chrome(options=options, service=Service(executable_path=str(driver)))
    d.set_page_load_timeout(PAGE_LOAD_TIMEOUT_S)
    return d


def _check_page(driver: Any, page: Path, screenshots: Path) -> PageCheck:
    driver.set_window_size(SCREEN_WIDTH_PX, 900)
    driver.get(page.resolve().as_uri())
    facts = driver.execute_script(_PAGE_FACTS_JS)
    console = [str(e.get("message")) for e in driver.get_log("browser") if e.get("level") == "SEVERE"]
    height = min(max(int(facts["height"]), 600), MAX_SCREENSHOT_HEIGHT_PX)
    driver.set_window_size(SCREEN_WIDTH_PX, height)
    shot = screenshots / f"{page.stem}.png"
    driver.get_screenshot_as_file(str(shot))
    return PageCheck(
        page=page.name, screenshot=shot, images=len(facts["images"]), tables=int(facts["tables"]),
        escaped_markup=[m.group(0)[:40] for m in ESCAPED_MARKUP.finditer(facts["text"])],
        broken_images=[i["src"] for i in facts["images"] if not i["complete"] or not i["width"]],
        tables_without_headers=int(facts["headless_tables"]), console_errors=console,
        overflowing_tables=list(facts["overflowing_tables"]),
        truncated_tables=TRUNCATED_TABLE.findall(facts["text"]),
        script_ran=bool(facts["pwned"]), visible_text=facts["text"],
        index_columns=list(facts["index_columns"]), float_noise=[c for c in facts["cells"] if FLOAT_NOISE.match(c)],
        figure_layout=list(facts["layout_problems"]))


def check_report_pages(report_dir: str | Path, pages: list[Path] | None = None) -> list[PageCheck]:
    """Load every page of ``report_dir`` in headless Chromium, check it and keep a screenshot of it in
    ``report_dir/screenshots/``. One browser for all pages; it is closed before returning."""
    report_dir = Path(report_dir)
    pages = pages or report_pages(report_dir)
    screenshots = report_dir / "screenshots"
    screenshots.mkdir(exist_ok=True)
    driver = _driver()
    try:
        return [_check_page(driver, page, screenshots) for page in pages]
    finally:
        driver.quit()
