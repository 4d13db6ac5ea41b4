-- KEYS: events, gen, active, history
-- ARGV: channel, maxlen, ttl, type, gid, data, final_state ('' if not final),
--       writer (the worker's id; '' for a gateway: no ownership check),
--       assistant message JSON ('' for none),
--       seq (the writer's 1, 2, 3... for this generation; '' or absent: no check),
--       epoch (the takeover its request carries; '' or absent: 0)
-- Returns the entry id, or false when refused (emit_event.lua says when).
return emit_event(KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[1], ARGV[2], ARGV[3], ARGV[4],
                  ARGV[5], ARGV[6], ARGV[7], ARGV[8], ARGV[9], tonumber(ARGV[10] or ''),
                  tonumber(ARGV[11] or '') or 0)
