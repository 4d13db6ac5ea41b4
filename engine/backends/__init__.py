"""Inference backends behind one small interface (``base.Backend``)."""
