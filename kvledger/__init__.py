"""kvledger: an event-sourced request-state tracker for vLLM's KV-cache connectors.

One import name, three packages:

- ``kvledger.tracker``: the core (events, the fold, plans); no I/O, no torch, no vLLM;
- ``kvledger.connector``: the vLLM connector, the recorder, the transfer backend and the tiers;
- ``kvledger.replay``: the log's readers and the ``kvledger`` command.

In the source tree the three live at the top (``tracker/``, ``connector/``, ``replay/``) and
this folder links to them, so a checkout, an editable install and a wheel all resolve
``kvledger.*`` the same way (docs/design-notes.md, note 21). Importing ``kvledger`` loads
nothing else.
"""
