"""The subcommands of ``kvledger``, a module per group; ``replay.cli`` builds the parser from
them and is the one entry point.

- ``common``: what every command shares (exit statuses, the error guard, damage reports, JSON);
- ``check``: ``check`` and its report;
- ``views``: ``diff``, ``show``, ``stats``, ``explain``: what a log holds, printed;
- ``exports``: ``timeline``, ``export``, ``sql``: the log handed to other tools;
- ``live``: ``demo`` (runs an engine) and ``tail`` (follows one's log).

Each command parses its arguments, calls one function of the library and turns its result into
text; none holds logic of its own about logs (the library modules of ``replay`` do).
"""
