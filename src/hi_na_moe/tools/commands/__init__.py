"""The CLI's commands, one module each (tools/cli.py parses the arguments and calls them); common.py
holds what they share."""
