#!/usr/bin/env python3
"""The HTML plan report in a real browser: Debian's chromium, headless.

  html_report_chromium_test.py <canzonactl>

Writes `simulate --html` and `plan --html` reports of a small job, then for
each: the file fetches nothing (no URL, src, href, import); chromium
--dump-dom shows the drawn elements (SVG charts, hundreds of rects) and the
page's script ran (data-rendered); chromium logs no console message; a
screenshot has content where the report draws (the title's text, the
load bars' and phases' exact colours). Two negative controls prove the
checks can fail: a page whose script throws must be caught by the console
check, a blank page by the pixel checks.

Exit 77 (ctest: skipped) only when no chromium is installed.
"""

import os
import re
import shutil
import subprocess
import sys
import tempfile

from PIL import Image  # Debian's python3-pil (deploy/lib/deps.sh)

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu",
                  "--disable-quic", "--no-first-run",
                  "--disable-background-networking",
                  "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars", "--force-device-scale-factor=1"]
WIDTH, HEIGHT = 1300, 1000


def chromium_binary():
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    return None


def chromium(binary, page, *extra, timeout=120):
    profile = tempfile.mkdtemp(prefix="canzona-chromium-")
    try:
        cmd = [binary] + CHROMIUM_FLAGS + [f"--user-data-dir={profile}"] + \
            list(extra) + ["file://" + os.path.abspath(page)]
        return subprocess.run(cmd, capture_output=True, text=True,
                              timeout=timeout)
    finally:
        shutil.rmtree(profile, ignore_errors=True)


def console_messages(binary, page):
    """Console output the page produced (chromium logs it as CONSOLE)."""
    result = chromium(binary, page, "--enable-logging=stderr", "--v=0",
                      "--dump-dom")
    return [line for line in result.stderr.splitlines()
            if "CONSOLE" in line or "Uncaught" in line]


def read_png(path):
    """(width, height, {(r, g, b): pixel count}, dark pixels of the title
    band)."""
    with Image.open(path) as image:
        rgb = image.convert("RGB")
        width, height = rgb.size
        counts = {color: n for n, color in rgb.getcolors(width * height)}
        title = rgb.crop((10, 5, 400, 40))
        dark = sum(n for n, c in title.getcolors(390 * 35) if sum(c) < 200)
    return width, height, counts, dark


def hex_rgb(color):
    return tuple(int(color[i:i + 2], 16) for i in (1, 3, 5))


def pixel_problems(png, colors, min_pixels):
    """What is missing from the screenshot (empty list: it looks right)."""
    width, height, counts, title = read_png(png)
    problems = []
    ink = sum(n for color, n in counts.items() if sum(color) < 600)
    if ink < 0.02 * width * height:
        problems.append(f"only {ink} non-white pixels of {width * height}")
    for name, color in colors.items():
        n = counts.get(hex_rgb(color), 0)
        if n < min_pixels:
            problems.append(f"{name} ({color}): {n} pixels < {min_pixels}")
    # The title: dark text in the top-left band.
    if title < 50:
        problems.append(f"no title text in the top-left band ({title} px)")
    return problems


def check_report(binary, page, colors, min_rects, failures):
    html = open(page).read()
    for fetch in ("http:", "https:", "src=", "href=", "@import", "url("):
        if fetch in html:
            failures.append(f"{page}: fetches something ({fetch})")
    dom = chromium(binary, page, "--dump-dom").stdout
    svgs = len(re.findall(r"<svg\b", dom))
    rects = len(re.findall(r"<rect\b", dom))
    if svgs < 5 or rects < min_rects:
        failures.append(f"{page}: {svgs} svg, {rects} rect in the DOM")
    if f'data-rendered="{svgs}"' not in dom:
        failures.append(f"{page}: the page's script did not run to its end")
    messages = console_messages(binary, page)
    if messages:
        failures.append(f"{page}: console: {messages[:3]}")
    png = page + ".png"
    chromium(binary, page, f"--screenshot={png}",
             f"--window-size={WIDTH},{HEIGHT}")
    if not os.path.exists(png):
        failures.append(f"{page}: no screenshot")
        return
    for problem in pixel_problems(png, colors, 200):
        failures.append(f"{page}: {problem}")


def main():
    binary = chromium_binary()
    if binary is None:
        print("chromium is not installed: skipped")
        return 77
    ctl = sys.argv[1]
    work = tempfile.mkdtemp(prefix="canzona-html-test-")
    failures = []
    try:
        job = ["--model", "qwen3-0.6b", "--layers", "4", "--vocab", "4096",
               "--dp", "4", "--tp", "2", "--bucket-size", "5000000"]
        sim_page = os.path.join(work, "simulate.html")
        subprocess.run([ctl, "simulate", "--profile", "h100-node", "--html",
                        sim_page] + job, check=True, capture_output=True)
        plan_page = os.path.join(work, "plan.html")
        subprocess.run([ctl, "plan", "--html", plan_page] + job, check=True,
                       capture_output=True)
        # Colours the report draws with (plan_report.cc): the cost and sc
        # load bars, and in the simulated report the DP-owned update, TP
        # compute and all-gather phases.
        plan_colors = {"cost bars": "#4e79a7", "sc bars": "#9c755f"}
        sim_colors = dict(plan_colors, **{"local_compute": "#59a14f",
                                          "tp_compute": "#e15759",
                                          "all_gather": "#b07aa1"})
        check_report(binary, sim_page, sim_colors, 150, failures)
        check_report(binary, plan_page, plan_colors, 60, failures)

        # Negative controls: the checks must see a broken and a blank page.
        broken = os.path.join(work, "broken.html")
        with open(broken, "w") as f:
            f.write("<html><body><p>x</p><script>throw new Error('boom');"
                    "</script></body></html>")
        if not console_messages(binary, broken):
            failures.append("negative control: a throwing page logged nothing")
        blank = os.path.join(work, "blank.html")
        with open(blank, "w") as f:
            f.write("<html><body></body></html>")
        chromium(binary, blank, f"--screenshot={blank}.png",
                 f"--window-size={WIDTH},{HEIGHT}")
        if not pixel_problems(blank + ".png", sim_colors, 200):
            failures.append("negative control: a blank page passed the "
                            "pixel checks")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for f in failures:
        print("FAIL:", f)
    if failures:
        return 1
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
