"""Host-side drivers of the jitted steps: generation loops (and, later, the serving engine)."""
