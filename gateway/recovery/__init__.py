"""Recovery: what one gateway's reaper repairs for all of them (lost workers' replies taken
over, requests past their deadline, stranded turns). It needs only the core and wire."""
