"""Command-line options shared by the estimate, plan and configs commands (argparse groups and the spec fields
they fill). Below ``io``, ``planning`` and ``configs``, so each command imports them without importing another."""
