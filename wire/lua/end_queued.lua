-- KEYS: gen, events, active
-- ARGV: channel, maxlen, ttl, gid, final state, final event JSON
-- Ends a generation that no worker has started (the gateway's queue deadline), the way a
-- queued cancel does: a worker that dequeues it later finds it final and skips it.
-- Returns the entry id, or false when it started or ended meanwhile (or expired).
if redis.call('HGET', KEYS[1], 'state') ~= 'queued' then return false end
if redis.call('HEXISTS', KEYS[1], 'final_id') == 1 then return false end
local id = emit(KEYS[2], KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[5], ARGV[4], ARGV[6])
finish(KEYS[1], KEYS[3], ARGV[4], ARGV[5], id, ARGV[6], ARGV[3])
return id
