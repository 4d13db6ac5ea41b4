"""The relay: one Redis reader per gateway process, fanned out to every open stream."""
