-- KEYS: the model's fair base (Keys.fair)
-- ARGV: TTL, then what a worker served since it last said: tenant, tokens, tenant, tokens...
-- Charges it (fair_charge), and renews the TTLs of the keys of the model's fair share: a
-- worker charges beside its takes every second while it serves (engine/worker.py).
local now = fair_now_ms()
for i = 2, #ARGV, 2 do fair_charge(KEYS[1], ARGV[i], tonumber(ARGV[i + 1]), now) end
fair_renew(KEYS[1], ARGV[1])
return 1
