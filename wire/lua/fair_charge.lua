-- KEYS: the model's fair base (Keys.fair)
-- ARGV: tenant, tokens, tenant, tokens...: what a worker served since it last said
for i = 1, #ARGV, 2 do fair_charge(KEYS[1], ARGV[i], tonumber(ARGV[i + 1])) end
return 1
