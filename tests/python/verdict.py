"""The verdict of a check script that collects its failures in a list: each failure printed as
"FAIL <what>", then PASS or FAIL; the process exit status (0 when nothing failed)."""


def verdict(bad):
    for b in bad:
        print("FAIL", b)
    print("PASS" if not bad else "FAIL")
    return 1 if bad else 0
