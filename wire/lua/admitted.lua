-- KEYS: the tenant's running key (wire/keys.py Keys.tenant; its sessions hash is a sibling)
-- ARGV: how long a running generation counts at most (ms: ADMIT's hold), how long after its
--       admission a generation is surely written (ms), at most how many to answer
-- The generations admitted at least that long ago, still counting as running, whose
-- session ADMIT recorded (admitted in a round trip of their own, before SUBMIT): the
-- reaper looks whether each exists (gateway/recovery/admissions.py).
-- Returns {generation id, session id, generation id, session id, ...}, oldest first.
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local due = redis.call('ZRANGEBYSCORE', KEYS[1], now, now + tonumber(ARGV[1]) - tonumber(ARGV[2]),
                       'LIMIT', 0, tonumber(ARGV[3]))
if #due == 0 then return {} end
local sessions = redis.call('HMGET', string.sub(KEYS[1], 1, -8) .. 'sessions', unpack(due))
local found = {}
for i, gid in ipairs(due) do
  if sessions[i] then
    found[#found + 1] = gid
    found[#found + 1] = sessions[i]
  end
end
return found
