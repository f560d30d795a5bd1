"""The lowest layer: the native extension, the config, the experts op and its reference, the
packed-expert store, checkpoint reading, memory and system facts. Imports nothing above it."""
