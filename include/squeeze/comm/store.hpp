#pragma once
// TcpStore: a tiny key-value store over TCP for bootstrapping (the NCCL unique id, rendezvous
// counters). Rank 0 hosts the server on MASTER_ADDR:MASTER_PORT in a background thread; every rank
// (rank 0 included) is a client. Every operation has a deadline and throws squeeze::Error naming the
// key, the address and the timeout when it passes, so a missing rank is an error, not a hang.
//
// Wire format (all integers little-endian u32/i64): request = op byte, key length, key, value length,
// value; reply = status byte, value length, value. ops: 'S' set, 'G' get (status 0: absent), 'A' add
// (value = i64 delta; reply = new i64 value). Waiting for a key is client-side polling with backoff,
// which keeps the server single-threaded and trivially correct.
//
// POSIX sockets only (Linux/macOS).
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "squeeze/error.hpp"

namespace squeeze::comm {

namespace detail {

using Clock = std::chrono::steady_clock;

inline std::string errno_text() { return std::strerror(errno); }

// Sends/receives exactly n bytes or throws once `deadline` passes.
inline void send_all(int fd, const void* data, std::size_t n, Clock::time_point deadline, std::string_view what) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    check(left > 0, "TcpStore: timed out sending " + std::string(what));
    pollfd pfd{fd, POLLOUT, 0};
    const int pr = ::poll(&pfd, 1, int(std::min<long long>(left, 1000)));
    if (pr < 0 && errno == EINTR) continue;
    check(pr >= 0, "TcpStore: poll failed: " + errno_text());
    if (pr == 0) continue;
    const ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL);
    if (k < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
    check(k > 0, "TcpStore: connection lost sending " + std::string(what) + ": " + errno_text());
    p += k;
    n -= std::size_t(k);
  }
}
inline void recv_all(int fd, void* data, std::size_t n, Clock::time_point deadline, std::string_view what) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    check(left > 0, "TcpStore: timed out receiving " + std::string(what));
    pollfd pfd{fd, POLLIN, 0};
    const int pr = ::poll(&pfd, 1, int(std::min<long long>(left, 1000)));
    if (pr < 0 && errno == EINTR) continue;
    check(pr >= 0, "TcpStore: poll failed: " + errno_text());
    if (pr == 0) continue;
    const ssize_t k = ::recv(fd, p, n, 0);
    if (k < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
    check(k > 0, "TcpStore: connection closed receiving " + std::string(what));
    p += k;
    n -= std::size_t(k);
  }
}

inline void put_u32(std::string& s, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) s.push_back(char((v >> (8 * i)) & 0xff));
}
inline std::uint32_t get_u32(const unsigned char* b) {
  return std::uint32_t(b[0]) | std::uint32_t(b[1]) << 8 | std::uint32_t(b[2]) << 16 | std::uint32_t(b[3]) << 24;
}
inline std::string encode_i64(std::int64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[std::size_t(i)] = char((std::uint64_t(v) >> (8 * i)) & 0xff);
  return s;
}
inline std::int64_t decode_i64(std::string_view s) {
  check(s.size() == 8, "TcpStore: counter value is not 8 bytes");
  std::uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= std::uint64_t(static_cast<unsigned char>(s[std::size_t(i)])) << (8 * i);
  return std::int64_t(v);
}

constexpr std::uint32_t kMaxField = 64u << 20;  // 64 MiB: a bootstrap store carries small values only

}  // namespace detail

// The server: one thread, poll() over the listening socket and its clients.
class TcpStoreServer {
 public:
  // port 0: pick a free port (see port()).
  explicit TcpStoreServer(std::uint16_t port, std::string bind_addr = "0.0.0.0") {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    check(fd_ >= 0, "TcpStoreServer: socket() failed: " + detail::errno_text());
    int one = 1;
    ::setsockopt(fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    if (::inet_pton(AF_INET, bind_addr.c_str(), &a.sin_addr) != 1) {
      ::close(fd_);
      throw Error("TcpStoreServer: bind address '" + bind_addr + "' is not an IPv4 address");
    }
    if (::bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(fd_, 512) != 0) {
      const std::string e = detail::errno_text();
      ::close(fd_);
      throw Error("TcpStoreServer: cannot listen on " + bind_addr + ":" + std::to_string(port) + ": " + e +
                  " (is MASTER_PORT already used?)");
    }
    socklen_t len = sizeof a;
    ::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
    thread_ = std::thread([this] { serve(); });
  }
  ~TcpStoreServer() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
    for (auto& c : clients_) ::close(c.fd);
    ::close(fd_);
  }
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;
  std::uint16_t port() const { return port_; }

 private:
  struct Client {
    int fd;
    std::string in;  // bytes received, not yet a whole request
  };

  void serve() {
    while (!stop_) {
      std::vector<pollfd> fds{{fd_, POLLIN, 0}};
      for (auto& c : clients_) fds.push_back({c.fd, POLLIN, 0});
      if (::poll(fds.data(), fds.size(), 50) <= 0) continue;
      if (fds[0].revents & POLLIN) {
        const int c = ::accept(fd_, nullptr, nullptr);
        if (c >= 0) {
          int one = 1;
          ::setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
          clients_.push_back({c, {}});
        }
      }
      for (std::size_t i = fds.size() - 1; i >= 1; --i) {
        if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
        auto& c = clients_[i - 1];
        char buf[4096];
        const ssize_t k = ::recv(c.fd, buf, sizeof buf, 0);
        bool drop = k <= 0;
        if (!drop) {
          c.in.append(buf, std::size_t(k));
          drop = !handle(c);
        }
        if (drop) {
          ::close(c.fd);
          clients_.erase(clients_.begin() + std::ptrdiff_t(i - 1));
        }
      }
    }
  }

  // Answers every whole request buffered for c; false drops a client that sent garbage.
  bool handle(Client& c) {
    for (;;) {
      const auto* b = reinterpret_cast<const unsigned char*>(c.in.data());
      if (c.in.size() < 5) return true;
      const std::uint32_t klen = detail::get_u32(b + 1);
      if (klen > detail::kMaxField) return false;
      if (c.in.size() < 9 + std::size_t(klen)) return true;
      const std::uint32_t vlen = detail::get_u32(b + 5 + klen);
      if (vlen > detail::kMaxField) return false;
      const std::size_t total = 9 + std::size_t(klen) + vlen;
      if (c.in.size() < total) return true;
      const char op = c.in[0];
      std::string key = c.in.substr(5, klen), value = c.in.substr(9 + klen, vlen);
      c.in.erase(0, total);
      std::string reply;
      if (op == 'S') {
        data_[key] = value;
        reply.push_back(1);
        detail::put_u32(reply, 0);
      } else if (op == 'G') {
        auto it = data_.find(key);
        reply.push_back(it != data_.end() ? 1 : 0);
        const std::string v = it != data_.end() ? it->second : std::string();
        detail::put_u32(reply, std::uint32_t(v.size()));
        reply += v;
      } else if (op == 'A') {
        if (value.size() != 8) return false;
        auto& slot = data_[key];
        const std::int64_t now = (slot.size() == 8 ? detail::decode_i64(slot) : 0) + detail::decode_i64(value);
        slot = detail::encode_i64(now);
        reply.push_back(1);
        detail::put_u32(reply, 8);
        reply += slot;
      } else {
        return false;
      }
      try {
        detail::send_all(c.fd, reply.data(), reply.size(), detail::Clock::now() + std::chrono::seconds(10), "reply");
      } catch (const Error&) {
        return false;
      }
    }
  }

  int fd_ = -1;
  std::uint16_t port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
  std::vector<Client> clients_;
  std::map<std::string, std::string> data_;
};

class TcpStore {
 public:
  // Connects to host:port, retrying until `timeout` (the server may start later than the client).
  // With is_server, also hosts the server on `port` first. `timeout` bounds every later operation.
  TcpStore(const std::string& host, std::uint16_t port, bool is_server, std::chrono::milliseconds timeout = std::chrono::seconds(300))
      : host_(host), timeout_(timeout) {
    if (is_server) {
      server_ = std::make_unique<TcpStoreServer>(port);
      port = server_->port();
    }
    port_ = port;
    connect_with_retry();
  }
  ~TcpStore() {
    if (fd_ >= 0) ::close(fd_);
  }
  TcpStore(const TcpStore&) = delete;
  TcpStore& operator=(const TcpStore&) = delete;

  std::uint16_t port() const { return port_; }
  std::chrono::milliseconds timeout() const { return timeout_; }

  void set(const std::string& key, std::string_view value) { request('S', key, value); }

  // The value of key, waiting for another rank to set it for at most `timeout` (default: the store's).
  std::string get(const std::string& key, std::chrono::milliseconds timeout = std::chrono::milliseconds(-1)) {
    const auto deadline = detail::Clock::now() + (timeout.count() < 0 ? timeout_ : timeout);
    auto backoff = std::chrono::milliseconds(1);
    for (;;) {
      auto [found, value] = request('G', key, {});
      if (found) return value;
      if (detail::Clock::now() >= deadline)
        throw Error("TcpStore: key '" + key + "' was not set within " + std::to_string((timeout.count() < 0 ? timeout_ : timeout).count()) +
                    " ms (server " + host_ + ":" + std::to_string(port_) + "); a rank is missing or started with a different WORLD_SIZE");
      std::this_thread::sleep_for(backoff);
      backoff = std::min(backoff * 2, std::chrono::milliseconds(50));
    }
  }
  // Present now? Never waits for the key.
  bool check_key(const std::string& key) { return request('G', key, {}).first; }
  void wait(const std::string& key, std::chrono::milliseconds timeout = std::chrono::milliseconds(-1)) { (void)get(key, timeout); }
  // Atomically adds delta to a counter (absent = 0) and returns the new value.
  std::int64_t add(const std::string& key, std::int64_t delta) {
    return detail::decode_i64(request('A', key, detail::encode_i64(delta)).second);
  }
  // Every one of `world` callers arrives before any returns (a counter plus a key the last one sets).
  // The rank hosting the server leaves last: it returns only after every other rank has had its last reply
  // (a departure counter), so destroying the store right after the barrier (NcclComm::from_env) cannot
  // close the connection under a rank still waiting for 'done'.
  void barrier(const std::string& name, int world, std::chrono::milliseconds timeout = std::chrono::milliseconds(-1)) {
    const std::string b = "barrier/" + name;
    if (add(b + "/count", 1) == world) set(b + "/done", "1");
    wait(b + "/done", timeout);
    if (!server_) {
      add(b + "/left", 1);
      return;
    }
    const auto limit = timeout.count() < 0 ? timeout_ : timeout;
    const auto deadline = detail::Clock::now() + limit;
    for (auto backoff = std::chrono::milliseconds(1); add(b + "/left", 0) < world - 1;
         backoff = std::min(backoff * 2, std::chrono::milliseconds(20))) {
      if (detail::Clock::now() >= deadline)
        throw Error("TcpStore: barrier '" + name + "': not every rank left within " + std::to_string(limit.count()) + " ms");
      std::this_thread::sleep_for(backoff);
    }
  }

 private:
  void connect_with_retry() {
    const auto deadline = detail::Clock::now() + timeout_;
    std::string last = "no attempt";
    for (auto backoff = std::chrono::milliseconds(10);; backoff = std::min(backoff * 2, std::chrono::milliseconds(1000))) {
      addrinfo hints{}, *res = nullptr;
      hints.ai_family = AF_UNSPEC;
      hints.ai_socktype = SOCK_STREAM;
      const int gai = ::getaddrinfo(host_.c_str(), std::to_string(port_).c_str(), &hints, &res);
      if (gai != 0) {
        last = std::string("cannot resolve host: ") + ::gai_strerror(gai);
      } else {
        for (addrinfo* ai = res; ai; ai = ai->ai_next) {
          const int fd = ::socket(ai->ai_family, ai->ai_socktype, ai->ai_protocol);
          if (fd < 0) continue;
          if (::connect(fd, ai->ai_addr, ai->ai_addrlen) == 0) {
            int one = 1;
            ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
            fd_ = fd;
            break;
          }
          last = detail::errno_text();
          ::close(fd);
        }
        ::freeaddrinfo(res);
      }
      if (fd_ >= 0) return;
      if (detail::Clock::now() + backoff >= deadline)
        throw Error("TcpStore: cannot connect to " + host_ + ":" + std::to_string(port_) + " within " + std::to_string(timeout_.count()) +
                    " ms (" + last + "); check MASTER_ADDR/MASTER_PORT and that rank 0 runs");
      std::this_thread::sleep_for(backoff);
    }
  }

  std::pair<bool, std::string> request(char op, const std::string& key, std::string_view value) {
    check(key.size() <= detail::kMaxField && value.size() <= detail::kMaxField, "TcpStore: key or value over 64 MiB");
    const auto deadline = detail::Clock::now() + timeout_;
    std::string msg(1, op);
    detail::put_u32(msg, std::uint32_t(key.size()));
    msg += key;
    detail::put_u32(msg, std::uint32_t(value.size()));
    msg += value;
    detail::send_all(fd_, msg.data(), msg.size(), deadline, "key '" + key + "'");
    unsigned char head[5];
    detail::recv_all(fd_, head, 5, deadline, "key '" + key + "'");
    const std::uint32_t vlen = detail::get_u32(head + 1);
    check(vlen <= detail::kMaxField, "TcpStore: corrupt reply for key '" + key + "'");
    std::string v(vlen, '\0');
    if (vlen) detail::recv_all(fd_, v.data(), vlen, deadline, "key '" + key + "'");
    return {head[0] != 0, std::move(v)};
  }

  std::string host_;
  std::uint16_t port_ = 0;
  std::chrono::milliseconds timeout_;
  std::unique_ptr<TcpStoreServer> server_;
  int fd_ = -1;
};

}  // namespace squeeze::comm
