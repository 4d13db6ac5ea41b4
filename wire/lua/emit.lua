-- KEYS: events, gen, active, history
-- ARGV: channel, maxlen, ttl, type, gid, data, final_state ('' if not final),
--       writer (the worker's id; '' for a gateway: no ownership check),
--       assistant message JSON ('' for none),
--       seq (the writer's 1, 2, 3... for this generation; '' or absent: no check),
--       epoch (the takeover its request carries; '' or absent: 0)
-- Returns the entry id, or false when the generation already ended (or expired), or the
-- writer (worker and epoch) does not own it: so "no event after the final one" and "one
-- worker per reply" hold whatever a writer does. 'started'/'resumed' claim a queued
-- generation; before the claim, the current epoch's writer may only end it (a prefill
-- error).
-- A seq at or below the generation's last written one is a retried write (a pipeline sent
-- again after a lost connection): nothing is written, and the reply is the id of the
-- latest event written, so a retry never shows a client an event twice. A seq past the
-- next one means events this writer had written are gone (a failover promoted a replica
-- that had not received them): instead of a silent gap, the generation ends here with an
-- error event, code 'events_lost', and the write is refused (false).
local seq = tonumber(ARGV[10] or '')
local writer, epoch = ARGV[8], tonumber(ARGV[11] or '') or 0
-- One read for the retry, state and owner checks: this runs for every token.
local seen = redis.call('HMGET', KEYS[2], 'seq', 'seq_id', 'state', 'final_id', 'worker',
                        'takeovers')
local last = tonumber(seen[1] or '0')
if seq and seq <= last then return seen[2] end
if (not seen[3]) or seen[4] then return false end
local claim = ARGV[4] == 'started' or ARGV[4] == 'resumed'
if claim and seen[3] ~= 'queued' then return false end
local lost = seq and seq > last + 1
if writer ~= '' then
  if epoch ~= tonumber(seen[6] or '0') then return false end
  if seen[3] == 'queued' then  -- not claimed: unless the claim itself was lost
    if not claim and not lost and ARGV[7] == '' then return false end
  elseif seen[5] ~= writer then return false end
end
if lost then
  local data = '{"type":"error","generation_id":' .. cjson.encode(ARGV[5]) ..
    ',"code":"events_lost","message":"Redis lost events of this reply (a failover to a ' ..
    'replica that had not received them); the reply ends here"}'
  local lost_id = emit(KEYS[1], KEYS[2], ARGV[1], ARGV[2], ARGV[3], 'error', ARGV[5], data)
  finish(KEYS[2], KEYS[3], ARGV[5], 'error', lost_id, data, ARGV[3])
  redis.call('EXPIRE', KEYS[1], ARGV[3])
  return false
end
local id = emit(KEYS[1], KEYS[2], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6])
if seq then redis.call('HSET', KEYS[2], 'seq', seq, 'seq_id', id) end
if claim then redis.call('HSET', KEYS[2], 'state', 'running', 'worker', writer) end
if ARGV[7] ~= '' then
  finish(KEYS[2], KEYS[3], ARGV[5], ARGV[7], id, ARGV[6], ARGV[3])
  if ARGV[9] ~= '' then
    redis.call('RPUSH', KEYS[4], ARGV[9])
    redis.call('EXPIRE', KEYS[4], ARGV[3])
  end
  redis.call('EXPIRE', KEYS[1], ARGV[3])
end
return id
