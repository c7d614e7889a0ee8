// Tree<T>: a leaf, a list of trees, or an ordered map of names to trees, as MAX's pytrees.
// flatten() lists the leaves depth-first in order; unflatten() rebuilds the same structure around
// new leaves, so a graph's inputs (a flat list) can be handed to a module as the tree it declared.
#pragma once

#include <cstddef>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "kiln/errors.h"

namespace kiln::graph {

template <class T>
class Tree {
 public:
  using List = std::vector<Tree>;
  using Map = std::vector<std::pair<std::string, Tree>>;  // insertion order is the leaf order

  Tree(T leaf) : node_(std::in_place_index<0>, std::move(leaf)) {}
  static Tree list(List items) { return Tree(std::in_place, Node(std::in_place_index<1>, std::move(items))); }
  static Tree map(Map items) {
    for (size_t i = 0; i < items.size(); ++i)
      for (size_t j = 0; j < i; ++j)
        if (items[i].first == items[j].first)
          throw ValueError("Tree::map: duplicate key '" + items[i].first + "'");
    return Tree(std::in_place, Node(std::in_place_index<2>, std::move(items)));
  }

  bool is_leaf() const { return node_.index() == 0; }
  bool is_list() const { return node_.index() == 1; }
  bool is_map() const { return node_.index() == 2; }
  const T& leaf() const { return require<0>("a leaf"); }
  const List& items() const { return require<1>("a list"); }
  const Map& entries() const { return require<2>("a map"); }
  const Tree& operator[](size_t i) const { return items().at(i); }
  const Tree& operator[](const std::string& key) const {
    for (const auto& [k, v] : entries())
      if (k == key) return v;
    throw ValueError("Tree: no key '" + key + "'");
  }

  size_t num_leaves() const {
    if (is_leaf()) return 1;
    size_t n = 0;
    if (is_list())
      for (const auto& t : items()) n += t.num_leaves();
    else
      for (const auto& [k, t] : entries()) n += t.num_leaves();
    return n;
  }

  std::vector<T> flatten() const {
    std::vector<T> out;
    flatten_into(out);
    return out;
  }

  // A tree of this shape whose leaves are `leaves`, in flatten() order; ValueError on a count mismatch.
  template <class U>
  Tree<U> unflatten(const std::vector<U>& leaves) const {
    if (leaves.size() != num_leaves())
      throw ValueError("Tree::unflatten: tree has " + std::to_string(num_leaves()) + " leaves, got " +
                       std::to_string(leaves.size()));
    size_t next = 0;
    return rebuild(leaves, next);
  }

  // Applies f to every leaf, keeping the structure.
  template <class F>
  auto map_leaves(F&& f) const -> Tree<decltype(f(std::declval<const T&>()))> {
    using U = decltype(f(std::declval<const T&>()));
    auto leaves = flatten();
    std::vector<U> mapped;
    mapped.reserve(leaves.size());
    for (const auto& l : leaves) mapped.push_back(f(l));
    return unflatten(mapped);
  }

 private:
  template <class> friend class Tree;
  using Node = std::variant<T, List, Map>;
  // Tagged so a leaf convertible to T never also converts to Node.
  Tree(std::in_place_t, Node n) : node_(std::move(n)) {}

  template <size_t I>
  const auto& require(const char* what) const {
    if (node_.index() != I) throw ValueError(std::string("Tree: not ") + what);
    return std::get<I>(node_);
  }

  void flatten_into(std::vector<T>& out) const {
    if (is_leaf()) {
      out.push_back(leaf());
    } else if (is_list()) {
      for (const auto& t : items()) t.flatten_into(out);
    } else {
      for (const auto& [k, t] : entries()) t.flatten_into(out);
    }
  }

  template <class U>
  Tree<U> rebuild(const std::vector<U>& leaves, size_t& next) const {
    if (is_leaf()) return Tree<U>(leaves[next++]);
    if (is_list()) {
      typename Tree<U>::List out;
      for (const auto& t : items()) out.push_back(t.rebuild(leaves, next));
      return Tree<U>::list(std::move(out));
    }
    typename Tree<U>::Map out;
    for (const auto& [k, t] : entries()) out.emplace_back(k, t.rebuild(leaves, next));
    return Tree<U>::map(std::move(out));
  }

  Node node_;
};

}  // namespace kiln::graph
