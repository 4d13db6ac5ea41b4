-- KEYS: the model's fair base (Keys.fair)
-- ARGV: how long a name is held (s), the worker, then the names of the prefixes a request it
--       ran left in its engine's cache (wire/prefixes.py held)
-- Adds the worker to each name's holders (hold_prefix, hold_core.lua). One Redis holds
-- them with the step's final events instead (emit_step.lua); this is a cluster's call.
local base, ttl, worker = KEYS[1], ARGV[1], ARGV[2]
for i = 3, #ARGV do hold_prefix(base, worker, ttl, ARGV[i]) end
return 1
