-- KEYS: the model's fair base (Keys.fair), its queue's notes of submits (Keys.submitting)
-- ARGV: tenant (its FairNames slot), weight, the list entry ('<estimate>|<request>':
--       WaitingRequest.element), TTL, the note
--       of the submit to cross off ('' for none: RequestQueue.note_submitting)
-- Queues a request in its tenant's list (fair_enqueue, wire/lua/fair_core.lua); a worker
-- moves it into the requests stream when its turn comes (FAIR_TAKE). The note goes only
-- with the request: a note is never crossed off without its request queued.
fair_enqueue(KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4])
if ARGV[5] ~= '' then redis.call('ZREM', KEYS[2], ARGV[5]) end
return 1
