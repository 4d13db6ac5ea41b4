-- KEYS: meta (a session's)
-- ARGV: now, title ('' for none: the turn had no text), follows ('1': the turn replaced the
--       first message, whose start the title follows unless a person named it)
-- A turn was queued: the session's meta notes when, and takes a title from the turn if it
-- has none. A meta Redis no longer holds (it lost the session since: a restart, a
-- failover) is not made again with these fields alone: a session with no token and no TTL
-- that still "exists" would hide its loss from its readers and take lost turns again.
-- Returns 1, or 0 when the meta is gone.
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'updated', ARGV[1])
if ARGV[2] ~= '' then
  if ARGV[3] == '1' and redis.call('HEXISTS', KEYS[1], 'named') == 0 then
    redis.call('HSET', KEYS[1], 'title', ARGV[2])
  else
    redis.call('HSETNX', KEYS[1], 'title', ARGV[2])
  end
end
return 1
