-- KEYS: the model's fair base (Keys.fair)
-- ARGV: the deadline (unix seconds), at most how many
-- Takes out of the tenants' lists the requests queued before the deadline (each list is
-- oldest first, so only its head is looked at) and returns them, for the reaper to end
-- (queue_timeout). A request taken out here and never ended (its reaper stopped) is ended
-- by the readers' deadline (gateway/recovery/reaper.py ReaderDeadline).
local base, deadline, most = KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2])
local ready, expired = base .. ':ready', {}
for _, tenant in ipairs(redis.call('ZRANGE', ready, 0, -1)) do
  local list = base .. ':t:' .. tenant
  while #expired < most do
    local head = redis.call('LINDEX', list, 0)
    if not head then break end
    local request = string.sub(head, string.find(head, '|', 1, true) + 1)
    local queued_at = tonumber(cjson.decode(request)['enqueued_at'] or deadline)
    if queued_at >= deadline then break end
    redis.call('LPOP', list)
    redis.call('HINCRBY', base, 'waiting', -1)
    table.insert(expired, request)
  end
  if redis.call('LLEN', list) == 0 then redis.call('ZREM', ready, tenant) end
end
return expired
