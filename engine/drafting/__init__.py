"""drafting"""
