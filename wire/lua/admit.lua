-- KEYS: the tenant's requests, running and tpm keys (wire/keys.py Keys.tenant; its
--       tpd:<day> key is their sibling, named from Redis's clock)
-- ARGV: the generation ids (space-separated; the first one names the request), '1' to
--       count the request ('0': another choice of a request counted already), the limits
--       (0: none): concurrent generations, requests per minute, tokens per minute, tokens
--       per UTC day; how long a running generation counts at most, in ms; the session the
--       generations are submitted to next (its SUBMIT is a round trip after this one)
-- Returns admit_tenant's answer (admit_core.lua).
return admit_tenant(string.sub(KEYS[1], 1, -9), ARGV[1], ARGV[2] == '1', tonumber(ARGV[3]),
                    tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7]),
                    ARGV[8])
