-- KEYS: gen
-- ARGV: worker (the one lost or stopping), max takeovers, usage JSON so far ('' unknown),
--       '1' when the worker stops it for another tenant's request (a preemption: it counts
--       as a takeover for the epoch, never against max takeovers),
--       '1' when the worker is thought lost and the caller ends a cancelled generation
-- Takes a running generation from its worker atomically (two reapers, or a reaper and the
-- stopping worker, never both hand it on). Returns {'takeover', takeovers, from}: queued
-- at the next epoch, queue its continuation | {'queued', takeovers, from}: not running,
-- queue it at that epoch | {'cancel', reason}: end it cancelled | {'exhausted'}: taken
-- over max times, end it | {'final'} | {'moved'} (another worker owns it): nothing to do
local g = redis.call('HMGET', KEYS[1], 'state', 'final_id', 'worker', 'cancel', 'takeovers',
                     'from', 'preempted')
if (not g[1]) or g[2] then return {'final'} end
local takeovers = tonumber(g[5] or '0')
if g[4] then
  -- A lost worker's: the caller ends it, billed what it reads streamed next. The worker
  -- (thought lost, it may live) loses it first, or a token it wrote between that read and
  -- the end would go out unbilled; it may still end it itself (its final event counts
  -- what it wrote), and one end wins.
  if ARGV[5] == '1' and g[1] ~= 'queued' then
    redis.call('HSET', KEYS[1], 'state', 'queued', 'worker', '')
  end
  return {'cancel', g[4]}
end
if g[1] == 'queued' then return {'queued', takeovers, g[6] or ''} end
if g[3] ~= ARGV[1] then return {'moved'} end
local preempted = tonumber(g[7] or '0')
if ARGV[4] == '1' then
  preempted = preempted + 1
  redis.call('HSET', KEYS[1], 'preempted', preempted)
elseif takeovers - preempted >= tonumber(ARGV[2]) then
  return {'exhausted'}
end
takeovers = takeovers + 1
redis.call('HSET', KEYS[1], 'state', 'queued', 'worker', '', 'takeovers', takeovers,
           'from', ARGV[1])
if ARGV[3] ~= '' then redis.call('HSET', KEYS[1], 'usage', ARGV[3]) end
redis.call('HDEL', KEYS[1], 'seq', 'seq_id')
return {'takeover', takeovers, ARGV[1]}
