"""Chunk IO: fetching chunk bytes and decoding them into window memory."""
