"""The help formatter of every `disagg` command line."""

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds "(default: X)" to a flag's help only where the help does not give its default itself
    and there is one to give (not None or False)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if "default" in (action.help or "") or action.default in (None, False, argparse.SUPPRESS):
            return action.help
        return super()._get_help_string(action)
