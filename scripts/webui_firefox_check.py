"""The chat page and the dashboard in Firefox, by hand: a smoke check outside `make test`.

Playwright's Firefox is a patched build downloaded from its vendor, so the browser test in `make test`
runs Chromium only. This drives Debian's `firefox-esr` over Marionette (Firefox's own remote protocol;
`pip install marionette_driver` in any venv) against a running `turbollm serve`:

    apt-get install firefox-esr
    turbollm serve smollm2-135m --port 8000 &
    python scripts/webui_firefox_check.py --base-url http://127.0.0.1:8000 [--api-key KEY]

It sends one message, waits for the streamed reply and its stats, opens the dashboard and reads its
token counter, and saves two screenshots. Exit code 0 when both views worked.
"""

from __future__ import annotations

import argparse
import base64
import json
import shutil
import subprocess
import sys
import tempfile
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key", default="")
    ap.add_argument("--out", default=".", help="folder for firefox-chat.png and firefox-dashboard.png")
    ap.add_argument("--port", type=int, default=2828, help="Marionette port")
    ns = ap.parse_args()
    from marionette_driver.by import By
    from marionette_driver.marionette import Marionette

    exe = shutil.which("firefox-esr") or shutil.which("firefox")
    if exe is None:
        sys.exit("no firefox-esr or firefox on the PATH (apt-get install firefox-esr)")
    profile = tempfile.mkdtemp(prefix="turbollm-ff-")
    ff = subprocess.Popen([exe, "--headless", "--marionette", "-no-remote", "-profile", profile],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        m = Marionette(host="127.0.0.1", port=ns.port, startup_timeout=60)
        m.start_session()
        m.set_window_rect(width=1100, height=750)
        print(f"Firefox {m.session_capabilities.get('browserVersion')}")
        m.navigate(ns.base_url + "/")
        if ns.api_key:
            m.execute_script("localStorage.setItem('turbollm.settings.v1', arguments[0]);",
                             script_args=[json.dumps({"api_key": ns.api_key})])
            m.navigate(ns.base_url + "/")
        for _ in range(40):
            if m.execute_script("return document.body.dataset.ready") == "1":
                break
            time.sleep(0.25)
        else:
            print("the page did not start (its scripts did not run)")
            return 1
        m.find_element(By.ID, "prompt").send_keys("Write a Python function that adds two numbers.")
        m.execute_script("document.getElementById('composer').requestSubmit()")
        stats = None
        for _ in range(240):
            time.sleep(0.25)
            stats = m.execute_script("const s = document.querySelector('.message.assistant:last-of-type "
                                     "[data-testid=stats], .message.assistant:last-of-type [data-testid=message-error]');"
                                     " return s ? s.textContent : null")
            if stats:
                break
        print(f"chat: {stats}")
        with open(f"{ns.out}/firefox-chat.png", "wb") as f:
            f.write(base64.b64decode(m.screenshot()))
        m.navigate(ns.base_url + "/dashboard")
        time.sleep(3)
        tokens = m.execute_script("const t = document.querySelector('[data-testid=tile-generation-tokens]');"
                                  " return t ? t.textContent : null")
        print(f"dashboard: {tokens} tokens generated")
        with open(f"{ns.out}/firefox-dashboard.png", "wb") as f:
            f.write(base64.b64decode(m.screenshot()))
        m.delete_session()
        ok = bool(stats and "tokens" in stats and tokens and int(tokens) > 0)
        print("ok" if ok else "FAILED")
        return 0 if ok else 1
    finally:
        ff.terminate()
        shutil.rmtree(profile, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
