"""Command lines of canzona's Python tools (the example trainer, the
benchmarks), with usage errors as canzonad's and canzonactl's: one line
on stderr naming the flag, exit status 2."""

import argparse


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, whose usage error is the one line
    ``prog: argument --steps: invalid int value: 'x'`` (argparse prints
    its whole usage first, which hides the line that says what is
    wrong; ``--help`` still shows it)."""

    def error(self, message):
        self.exit(2, "%s: %s\n" % (self.prog, message))


def positive_int(text):
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(
            "%r is not an integer >= 1" % text)
    return value
