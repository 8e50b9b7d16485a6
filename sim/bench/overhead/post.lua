-- wrk script for the kvroute overhead benchmark.
--
--   wrk -s post.lua http://127.0.0.1:PORT -- BODIES_FILE [PATH] [OFFSET]
--
-- BODIES_FILE holds one JSON request body per line. Every request is built
-- once, in init(), so that sending one costs wrk a single write of a ready
-- string, whatever the body size. Requests are sent in file order, cycling;
-- OFFSET (default 0) shifts the starting body. done() prints one JSON line
-- that bench.py reads (latencies in microseconds).

local requests = {}
local count = 0
local next_index = 0

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
end

function request()
  next_index = next_index % count + 1
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
