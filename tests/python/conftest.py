"""Prints the worst reference-vs-daemon errors measured by test_reference.py."""


def pytest_terminal_summary(terminalreporter):
    import sys

    module = sys.modules.get("test_reference")
    measured = getattr(module, "MEASURED", None)
    if not measured:
        return
    terminalreporter.section("canzona reference vs daemon: worst relative errors")
    for optimizer in sorted(measured):
        m = measured[optimizer]
        terminalreporter.write_line(
            f"{optimizer:8s} {m['cases']:2d} cases  max|out-ref|/max|ref| = {m['rel']:.2e}"
            f" ({m['worst']})  max|out-ref|/max|ref-p| = {m['displacement']:.2e}"
        )
