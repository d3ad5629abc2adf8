"""The `kvfid` commands, declared with click: each parses its options, calls one library function
(imported when the command runs, so `kvfid --help` loads no torch) and prints.

`options` holds the option groups several commands share; `environment`, `diagnose` and `runs`
the commands; `kvfid.cli` the group that gathers them and maps errors to exit codes.
"""
