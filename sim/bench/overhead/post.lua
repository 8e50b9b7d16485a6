-- wrk script for the kvroute overhead benchmark.
--
--   wrk -s post.lua http://127.0.0.1:PORT -- BODIES_FILE [PATH] [OFFSET] [SALT]
--
-- BODIES_FILE holds one JSON request body per line. Every request is built
-- once, in init(), so that sending one costs wrk a single write of a ready
-- string, whatever the body size. Requests are sent in file order, cycling;
-- OFFSET (default 0) shifts the starting body. done() prints one JSON line
-- that bench.py reads (latencies in microseconds).
--
-- With SALT (8 hex digits), the bodies carry bodies.py's MARKER and every
-- request replaces it with SALT and a count in 8 hex digits: a prompt no
-- router has seen, at the cost of one concatenation per request. bench.py
-- gives each wrk run a SALT of its own.

local MARKER = string.rep("@", 16)
local requests = {}
local heads = {}
local tails = {}
local count = 0
local next_index = 0
local salt = nil
local sent = 0

function init(args)
  local file = args[1]
  local path = args[2] or "/v1/chat/completions"
  local headers = { ["Content-Type"] = "application/json" }
  for line in io.lines(file) do
    if #line > 0 then
      count = count + 1
      requests[count] = wrk.format("POST", path, headers, line)
    end
  end
  if count == 0 then
    error("no request bodies in " .. tostring(file))
  end
  next_index = (tonumber(args[3]) or 0) % count
  salt = args[4]
  if salt then
    if not string.match(salt, "^%x%x%x%x%x%x%x%x$") then
      error("SALT must be 8 hex digits, not " .. salt)
    end
    for i = 1, count do
      local s, e = string.find(requests[i], MARKER, 1, true)
      if not s then
        error("body " .. i .. " of " .. file .. " has no marker; generate it with marker=True")
      end
      heads[i] = string.sub(requests[i], 1, s - 1)
      tails[i] = string.sub(requests[i], e + 1)
    end
  end
end

function request()
  next_index = next_index % count + 1
  if salt then
    sent = sent + 1
    return heads[next_index] .. salt .. string.format("%08x", sent) .. tails[next_index]
  end
  return requests[next_index]
end

function done(summary, latency, requests_stats)
  local e = summary.errors
  io.write(string.format(
    '{"requests":%d,"duration_us":%d,"bytes":%d,'
      .. '"errors":{"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d},'
      .. '"latency_us":{"min":%d,"mean":%.2f,"stdev":%.2f,"p10":%d,"p25":%d,"p50":%d,"p90":%d,"p99":%d,"p999":%d,"max":%d}}\n',
    summary.requests, summary.duration, summary.bytes,
    e.connect, e.read, e.write, e.status, e.timeout,
    latency.min, latency.mean, latency.stdev,
    latency:percentile(10), latency:percentile(25), latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency:percentile(99.9), latency.max))
end
