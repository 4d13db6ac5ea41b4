-- A tenant's usage, counted once per generation where its final event is written (loaded
-- in front of emit_core.lua, whose ``finish`` calls ``count_usage``; wire/tenancy.py's
-- COUNT_USAGE runs ``add_usage`` on a Redis Cluster, where the tenant's keys are on a slot
-- of their own and the writer counts right after the final event, once per generation).
-- A tenant's keys: <prefix>:tenant:{<tenant id>}:<name> (wire/keys.py Keys.tenant).
-- On a cluster wire/scripts.py swaps this line (the count goes through COUNT_USAGE).
local count_here = true
local HOUR_TTL, DAY_TTL, TPM_TTL, TPD_TTL = 3888000, 34560000, 120, 172800
-- base: the tenant's key prefix; bill: 'all', 'completion' (another choice of a request:
-- its prompt is billed with choice 0) or 'none' (tokenize, detokenize); usage: the final
-- event's {prompt_tokens, completion_tokens}, or nil (an error with none recorded).
-- Counts prompt and completion tokens per UTC hour and day, the tokens of the last minute
-- (per-second buckets) and of the day, and drops the generation from the running ones.
local function add_usage(base, gid, bill, usage)
  redis.call('ZREM', base .. 'running', gid)
  redis.call('HDEL', base .. 'sessions', gid)
  if bill == 'none' then return end
  local prompt, completion = 0, 0
  if type(usage) == 'table' then
    if bill ~= 'completion' then prompt = tonumber(usage['prompt_tokens']) or 0 end
    completion = tonumber(usage['completion_tokens']) or 0
  end
  local now = tonumber(redis.call('TIME')[1])
  local day = math.floor(now / 86400)
  for _, period in ipairs({{'hour:' .. math.floor(now / 3600), HOUR_TTL},
                           {'day:' .. day, DAY_TTL}}) do
    local key = base .. 'usage:' .. period[1]
    redis.call('HINCRBY', key, 'prompt_tokens', prompt)
    redis.call('HINCRBY', key, 'completion_tokens', completion)
    redis.call('HINCRBY', key, 'generations', 1)
    redis.call('EXPIRE', key, period[2])
  end
  local total = prompt + completion
  if total > 0 then
    redis.call('HINCRBY', base .. 'tpm', now, total)
    redis.call('EXPIRE', base .. 'tpm', TPM_TTL)
    redis.call('INCRBY', base .. 'tpd:' .. day, total)
    redis.call('EXPIRE', base .. 'tpd:' .. day, TPD_TTL)
  end
end
-- The prefix of a tenant's keys (wire/keys.py Keys.tenant), from one of its generations'
-- keys (<prefix>:{<sid>}:...): one Redis holds both.
local function tenant_base(gen, tenant)
  return string.match(gen, '^(.-):{') .. ':tenant:{' .. tenant .. '}:'
end
-- gen: the generation's key (<prefix>:{<sid>}:gen:<gid>); data: its final event's JSON.
-- Its tenant and what to bill were written by SUBMIT; an error final that carries no usage
-- counts what the takeover recorded (the tokens streamed before it).
local function count_usage(gen, gid, data)
  if not count_here then return end
  local g = redis.call('HMGET', gen, 'tenant', 'bill', 'usage')
  if not g[1] or g[1] == '' then return end  -- nobody to bill (made by an older gateway)
  local usage = cjson.decode(data)['usage']
  if type(usage) ~= 'table' and g[3] then usage = cjson.decode(g[3]) end
  add_usage(tenant_base(gen, g[1]), gid, g[2], usage)
end
