#!/usr/bin/env python3
"""Checks of envoy/observability/ against a real Prometheus (stdlib only).

  coverage RULES TESTS
      every alert in RULES has a promtool test case in TESTS where it fires.
  live PROM_URL DASHBOARD [--report FILE]
      asks a running Prometheus (which loaded the rules) for every rule it loaded, and
      evaluates through its HTTP API every recording rule (its recorded series and its
      expression), every alert expression with each comparison made `bool` (so an alert
      that is not firing still has to return series: an operand naming a metric that does
      not exist, or labels that never match, return none) and every dashboard panel query.
      Any query returning no series fails. --prior-passed/--prior-failed fold earlier
      checks into the closing line.
  firing PROM_URL ALERT LABEL=VALUE [--wait S]
      waits until ALERT is firing with that label.

The last line is `N passed, N failed`.
"""

import argparse
import json
import re
import sys
import time
import urllib.parse
import urllib.request

COMPARISONS = ("==", "!=", ">=", "<=", ">", "<")


def boolify(expr):
    """Adds `bool` after every comparison operator outside label matchers and strings."""
    out, i, depth, quote = [], 0, 0, None
    while i < len(expr):
        c = expr[i]
        if quote:
            out.append(c)
            if c == "\\" and i + 1 < len(expr):
                out.append(expr[i + 1])
                i += 2
                continue
            if c == quote:
                quote = None
            i += 1
            continue
        if c in "\"'`":
            quote = c
        elif c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
        elif depth == 0:
            op = next((o for o in COMPARISONS if expr.startswith(o, i)), None)
            if op and not expr.startswith(("=~", "!~"), i):
                rest = expr[i + len(op):]
                out.append(op)
                i += len(op)
                if not re.match(r"\s*bool\b", rest):
                    out.append(" bool")
                continue
        out.append(c)
        i += 1
    return "".join(out)


def query(prom, expr):
    url = prom.rstrip("/") + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.load(r)
    if body.get("status") != "success":
        raise RuntimeError(body.get("error", "query failed"))
    return body["data"]["result"]


def get(prom, path):
    with urllib.request.urlopen(prom.rstrip("/") + path, timeout=10) as r:
        return json.load(r)["data"]


def dashboard_queries(path, rate_interval):
    dash = json.load(open(path))
    for panel in dash.get("panels", []):
        for t in panel.get("targets", []):
            expr = t["expr"].replace("$__rate_interval", rate_interval)
            yield f"panel '{panel['title']}' {t['refId']}", expr


def coverage(args):
    rules = open(args.rules).read()
    tests = open(args.tests).read()
    alerts = re.findall(r"^\s*- alert:\s*(\S+)", rules, re.M)
    # A case fires when an `alertname:` is followed by exp_alerts with at least one entry.
    fired = set(re.findall(r"alertname:\s*(\S+)\s*\n\s*exp_alerts:\s*\n\s*- exp_labels", tests))
    passed = failed = 0
    for a in alerts:
        if a in fired:
            passed += 1
        else:
            failed += 1
            print(f"FAIL: alert {a} has no promtool test case where it fires")
    print(f"{len(alerts)} alerts, {len(fired & set(alerts))} with a firing test case")
    print(f"coverage: {passed} passed, {failed} failed")
    return failed == 0


def live(args):
    checks = []  # (name, expr)
    for group in get(args.prom, "/api/v1/rules")["groups"]:
        for rule in group["rules"]:
            if rule["type"] == "recording":
                checks.append((f"recorded {rule['name']}", rule["name"]))
                checks.append((f"expr of {rule['name']}", rule["query"]))
            else:
                checks.append((f"alert {rule['name']} (comparisons as bool)", boolify(rule["query"])))
    n_rules = len(checks)
    checks += list(dashboard_queries(args.dashboard, args.rate_interval))
    if n_rules == 0:
        print("FAIL: Prometheus loaded no rules")
        print("0 passed, 1 failed")
        return False
    passed = failed = 0
    report = ["| check | series | first value | query |", "|---|---|---|---|"]
    for name, expr in checks:
        try:
            result = query(args.prom, expr)
        except Exception as e:  # an invalid query is a failure, with Prometheus's words
            result, err = [], str(e)
        else:
            err = ""
        value = result[0]["value"][1] if result else ""
        report.append(f"| {name} | {len(result)} | {value} | `{expr}` |")
        if result:
            passed += 1
        else:
            failed += 1
            print(f"FAIL: {name}: no series{' (' + err + ')' if err else ''}\n    {expr}")
    passed += args.prior_passed
    failed += args.prior_failed
    if args.report:
        open(args.report, "w").write("\n".join(report) + "\n")
    print(f"{n_rules} rule queries, {len(checks) - n_rules} dashboard queries"
          f"{f', {args.prior_passed + args.prior_failed} earlier check(s)' if args.prior_passed + args.prior_failed else ''}")
    print(f"observability: {passed} passed, {failed} failed")
    return failed == 0


def firing(args):
    """Waits until ALERT is firing with LABEL=VALUE."""
    key, _, want = args.label.partition("=")
    deadline = time.time() + args.wait
    state, started = "absent", time.time()
    while time.time() < deadline:
        alerts = [a for a in get(args.prom, "/api/v1/alerts")["alerts"]
                  if a["labels"].get("alertname") == args.alert and a["labels"].get(key) == want]
        state = alerts[0]["state"] if alerts else "absent"
        if state == "firing":
            value = float(alerts[0]["value"])
            print(f"ok: {args.alert} firing for {key}={want} (value {value:.3f}) after {time.time() - started:.0f} s")
            return True
        time.sleep(1)
    print(f"FAIL: {args.alert} for {key}={want}: {state} after {args.wait:.0f} s")
    return False


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("coverage")
    c.add_argument("rules")
    c.add_argument("tests")
    lv = sub.add_parser("live")
    lv.add_argument("prom")
    lv.add_argument("dashboard")
    lv.add_argument("--prior-passed", type=int, default=0)
    lv.add_argument("--prior-failed", type=int, default=0)
    lv.add_argument("--rate-interval", default="30s")
    lv.add_argument("--report")
    f = sub.add_parser("firing")
    f.add_argument("prom")
    f.add_argument("alert")
    f.add_argument("label", help="LABEL=VALUE the firing alert must carry")
    f.add_argument("--wait", type=float, default=60)
    args = p.parse_args()
    ok = {"coverage": coverage, "live": live, "firing": firing}[args.cmd](args)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
