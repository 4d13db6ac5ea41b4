-- A tenant's usage, counted once per generation where its final event is written (loaded
-- in front of emit_core.lua, whose ``finish`` calls ``count_usage``; wire/tenancy.py's
-- COUNT_USAGE runs ``add_usage`` on a Redis Cluster, where the tenant's keys are on a slot
-- of their own and the writer counts right after the final event, once per generation).
-- A tenant's keys: <prefix>:tenant:{<tenant id>}:<name> (wire/keys.py Keys.tenant).
-- On a cluster wire/scripts.py swaps this line (the count goes through COUNT_USAGE).
local count_here = true
local HOUR_TTL, DAY_TTL, TPM_TTL = 3888000, 34560000, 120
-- base: the tenant's key prefix; bill: 'all', 'completion' (another choice of a request:
-- its prompt is billed with choice 0) or 'none' (tokenize, detokenize); usage: the final
-- event's {prompt_tokens, completion_tokens}, or nil (an error with none recorded);
-- counts: what its key's limits keep besides (SUBMIT wrote them with the generation,
-- wire/scripts.py usage_counts): 'held' (it counts among the key's running generations,
-- a concurrency limit), 'tpm' (the key's tokens of the last minute, per-second buckets).
-- Counts prompt and completion tokens per UTC hour and day (the day's total is what a
-- tokens-per-day limit reads), and what ``counts`` names. A hash's TTL is set as it is
-- made (its first generation): one call less for every other.
local function add_usage(base, gid, bill, usage, counts)
  if string.find(counts, 'held', 1, true) then
    redis.call('ZREM', base .. 'running', gid)
    redis.call('HDEL', base .. 'sessions', gid)
  end
  if bill == 'none' then return end
  local prompt, completion = 0, 0
  if type(usage) == 'table' then
    if bill ~= 'completion' then prompt = tonumber(usage['prompt_tokens']) or 0 end
    completion = tonumber(usage['completion_tokens']) or 0
  end
  local now = tonumber(redis.call('TIME')[1])
  for _, period in ipairs({{'hour:' .. math.floor(now / 3600), HOUR_TTL},
                           {'day:' .. math.floor(now / 86400), DAY_TTL}}) do
    local key = base .. 'usage:' .. period[1]
    redis.call('HINCRBY', key, 'prompt_tokens', prompt)
    redis.call('HINCRBY', key, 'completion_tokens', completion)
    if redis.call('HINCRBY', key, 'generations', 1) == 1 then
      redis.call('EXPIRE', key, period[2])
    end
  end
  local total = prompt + completion
  if total > 0 and string.find(counts, 'tpm', 1, true) then
    if redis.call('HINCRBY', base .. 'tpm', now, total) == total then
      redis.call('EXPIRE', base .. 'tpm', TPM_TTL)  -- a new second: the hash lives on
    end
  end
end
-- What a generation's end counts when SUBMIT did not say (made by an older gateway).
local USAGE_COUNTS_ALL = 'held tpm'
-- The prefix of a tenant's keys (wire/keys.py Keys.tenant), from one of its generations'
-- keys (<prefix>:{<sid>}:...): one Redis holds both.
local function tenant_base(gen, tenant)
  return string.match(gen, '^(.-):{') .. ':tenant:{' .. tenant .. '}:'
end
-- gen: the generation's key (<prefix>:{<sid>}:gen:<gid>); data: its final event's JSON;
-- g: its fields 'tenant', 'bill', 'usage', 'counts' as read (emit_core.lua FINISH_READS).
-- Its tenant, what to bill and what else to count were written by SUBMIT; an error final
-- that carries no usage counts what the takeover recorded (the tokens streamed before it).
local function count_usage(gen, gid, data, g)
  if not count_here then return end
  if not g[1] or g[1] == '' then return end  -- nobody to bill (made by an older gateway)
  local usage = cjson.decode(data)['usage']
  if type(usage) ~= 'table' and g[3] then usage = cjson.decode(g[3]) end
  add_usage(tenant_base(gen, g[1]), gid, g[2], usage, g[4] or USAGE_COUNTS_ALL)
end
