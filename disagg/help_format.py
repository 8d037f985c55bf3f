"""The help formatter of every `disagg` command line."""

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds "(default: X)" to a flag's help only where the help does not give its default itself
    and there is one to give (not None or False). A switch gets none: its help says what it turns on
    or off, and a default of True on --disable-x would read as the opposite."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if ("default" in (action.help or "") or action.default in (None, False, argparse.SUPPRESS)
                or action.nargs == 0):
            return action.help
        return super()._get_help_string(action)
